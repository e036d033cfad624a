"""The draft model of speculative decoding (``--speculative draft``): a small
model sharing the target's tokenizer, run by the worker after each step to
propose the tokens that the next step verifies.

It has its own paged KV cache and block pool (``--draft-num-blocks``; by
default as many blocks as the target's cache) and its own ``InputBatch``;
the scheduler never sees its blocks. Per sequence it keeps the tokens the
sequence is known to hold (from the plans' chunks, their cached prefix
``draft_context_token_ids`` and the step's sampled tokens) and the tokens
whose K/V its cache holds:

    [0, valid)       cached == known: kept (valid = their common prefix)
    [valid, known)   computed again by the next catch-up (rejected drafts
                     are overwritten there: the rollback is the common prefix)

A plan's ``num_proposals = k`` on a sampling chunk asks, after the step, for
k greedy tokens: one catch-up forward over ``[valid, known)`` of every asked
sequence (split to the step budget), whose last position's argmax is the
first proposal, then k - 1 one-token forwards. What it proposes never
changes the output (the target verifies it); only how many tokens a step
yields. A sequence that cannot get draft blocks (the pool is full) or that
reaches the draft's context length gets no proposal that step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
from jitney.engine.v1 import engine_pb2
from jitney.worker.attention.backends import make_attention_backend
from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache
from jitney.worker.config import WorkerConfig
from jitney.worker.loading.loader import load_model
from jitney.worker.loading.weights_cache import WeightsCache
from jitney.worker.models.config import ModelFacts, UnsupportedModelError
from jitney.worker.runner.input_batch import InputBatch, StepChunk
from jitney.worker.runner.plan_checks import PlanError

logger = logging.getLogger("jitney.worker")

MAX_PROPOSALS = 64   # the scheduler's MAX_SPECULATIVE_TOKENS


@dataclass
class _Sequence:
    known: list[int] = field(default_factory=list)    # the sequence's tokens, positions 0..
    cached: list[int] = field(default_factory=list)   # tokens whose K/V the draft cache holds
    blocks: list[int] = field(default_factory=list)   # its draft block table
    # cached[:checked] == known[:checked], found so: a sequence's known tokens change only
    # from its last computed position on, which is past those the draft caught up on.
    checked: int = 0
    lost: bool = False   # its history is not known (cannot be drafted)


class DraftModel:
    """Loads the draft (``config.draft_model``), checked against the target;
    ``reserve_blocks`` then allocates its cache."""

    def __init__(self, config: WorkerConfig, target: ModelFacts, dtype: torch.dtype, device: torch.device,
                 batch_invariant: bool, weights_cache: WeightsCache | None) -> None:
        assert config.draft_model is not None
        if config.tp_size > 1:
            raise UnsupportedModelError("a draft model (--draft-model) runs without tensor parallelism only")
        self.model, self.facts = load_model(config.draft_model, dtype, device, config.max_model_len,
                                            batch_invariant=batch_invariant, weights_cache=weights_cache)
        check_same_vocabulary(config.model, config.draft_model, target, self.facts)
        self.config, self.device, self.dtype = config, device, dtype
        backend = make_attention_backend(config.attention_backend, device, batch_invariant=batch_invariant)
        self.model.use_backend(backend, self.facts.context_length)
        cfg = self.model.config
        self.geometry = CacheGeometry(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.context_length = self.facts.context_length
        self._seqs: dict[int, _Sequence] = {}

    def reserve_blocks(self, num_blocks: int, max_num_tokens: int, max_num_seqs: int) -> None:
        """Allocate the cache (``num_blocks``) and the batch rows; warm the kernels up."""
        self.num_blocks = num_blocks
        self.cache = PagedKVCache(self.geometry, num_blocks, self.device, self.model.backend.block_shapes(self.geometry))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self.max_num_tokens = max_num_tokens
        self.batch = InputBatch(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                                max_blocks_per_seq=-(-self.context_length // self.config.block_size),
                                block_size=self.config.block_size, device=self.device,
                                vocab_size=self.facts.vocab_size)
        self._warm_up()
        logger.info("draft model %s: KV cache of %d blocks (%.2f GiB)", self.facts.name, num_blocks,
                    self.cache.nbytes / 2**30)

    def _warm_up(self) -> None:
        """One catch-up and one greedy step, so no request compiles a kernel variant first."""
        probe = (1 << 64) - 1   # (no plan names it: seq ids come from 1 up)
        self._seqs[probe] = _Sequence(known=[0] * min(8, self.context_length - 2))
        self.propose([(probe, 2)])
        self.free(probe)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    # -- following the sequences -------------------------------------------

    def check_plan(self, plan: engine_pb2.StepPlan) -> None:
        """The plan's draft fields (``PlanError``), before anything is applied."""
        for chunk in plan.chunks:
            if chunk.num_proposals and not chunk.sample:
                raise PlanError(f"seq {chunk.seq_id}: num_proposals on a chunk that does not sample")
            if chunk.num_proposals > MAX_PROPOSALS:
                raise PlanError(f"seq {chunk.seq_id}: num_proposals {chunk.num_proposals} exceeds {MAX_PROPOSALS}")
        for new in plan.new_sequences:
            ids = new.draft_context_token_ids
            if ids and max(ids) >= self.facts.vocab_size:
                raise PlanError(f"seq {new.seq_id}: draft context token id {max(ids)} outside the vocab")

    def apply(self, plan: engine_pb2.StepPlan) -> None:
        """Freed sequences give their draft blocks back; new ones start from their context."""
        for sid in plan.freed_seq_ids:
            self.free(sid)
        for new in plan.new_sequences:
            self._seqs[new.seq_id] = _Sequence(known=list(new.draft_context_token_ids))

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._free_blocks.extend(reversed(seq.blocks))
        if seq_id in self.batch.rows:
            self.batch.remove(seq_id)

    def forget_all(self) -> None:
        for sid in list(self._seqs):
            self.free(sid)

    def observe(self, chunks: Sequence[StepChunk], result: engine_pb2.StepResult) -> None:
        """The step's chunks computed their tokens (drafts but the accepted ones
        excluded) and yielded ``result``'s tokens: the sequences' known tokens."""
        yielded: dict[int, list[int]] = {}
        for sid, token in zip(result.seq_ids, result.token_ids):
            yielded.setdefault(sid, []).append(token)
        for c in chunks:
            seq = self._seqs.get(c.seq_id)
            if seq is None or seq.lost:
                continue
            if len(seq.known) < c.start:   # (a prefix it was never told of)
                seq.lost = True
                continue
            del seq.known[c.start:]
            seq.known.extend(int(t) for t in c.tokens[:len(c.tokens) - c.num_drafts])
            seq.known.extend(yielded.get(c.seq_id, ()))

    # -- proposing ----------------------------------------------------------

    def propose(self, asked: Sequence[tuple[int, int]]) -> list[engine_pb2.DraftProposal]:
        """Up to k greedy tokens for each asked (seq id, k), after its known tokens."""
        work: dict[int, int] = {}     # seq id -> tokens to propose
        for sid, k in asked:
            seq = self._seqs.get(sid)
            if seq is None or seq.lost or not seq.known:
                continue
            end = len(seq.known)
            k = min(k, self.context_length - end)   # its guesses' positions stay in the draft's context
            if k > 0 and self._roll_back_and_reserve(sid, seq, end + k - 1):
                work[sid] = k
        if not work:
            return []
        drafts = {sid: [token] for sid, token in self._catch_up(list(work)).items()}
        for i in range(1, max(work.values())):
            chunks = [StepChunk(sid, len(self._seqs[sid].known) + i - 1, [d[-1]], True, n)
                      for n, (sid, d) in enumerate(drafts.items()) if work[sid] > i]
            for sid, token in self._forward(chunks).items():
                self._seqs[sid].cached.append(drafts[sid][-1])
                drafts[sid].append(token)
        return [engine_pb2.DraftProposal(seq_id=sid, start_position=len(self._seqs[sid].known), token_ids=d)
                for sid, d in drafts.items()]

    def _roll_back_and_reserve(self, sid: int, seq: _Sequence, positions: int) -> bool:
        """Cut the cache's tokens to their common prefix with the known ones (the last
        known token is always computed again: its logits give the first guess) and hold
        blocks for ``positions`` positions; False (nothing held) if the pool is short."""
        limit = min(len(seq.cached), len(seq.known) - 1)
        valid = min(seq.checked, limit)
        while valid < limit and seq.cached[valid] == seq.known[valid]:
            valid += 1
        del seq.cached[valid:]
        seq.checked = valid
        needed = -(-positions // self.config.block_size) - len(seq.blocks)
        if needed > len(self._free_blocks):
            return False
        if sid not in self.batch.rows:
            self.batch.add(sid, 0.0, 1.0, 0, 0)
        if needed > 0:
            new = [self._free_blocks.pop() for _ in range(needed)]
            seq.blocks.extend(new)
            self.batch.extend_blocks(sid, new)
        return True

    def _catch_up(self, seq_ids: list[int]) -> dict[int, int]:
        """Compute each sequence's known tokens past its cached ones, in forwards of
        at most the step budget; the greedy token after each last known one."""
        firsts: dict[int, int] = {}
        pending = [(sid, len(self._seqs[sid].cached)) for sid in seq_ids]
        while pending:
            chunks: list[StepChunk] = []
            left, rest = self.max_num_tokens, []
            for sid, start in pending:
                seq = self._seqs[sid]
                n = min(len(seq.known) - start, left)
                if n <= 0:
                    rest.append((sid, start))
                    continue
                done = start + n == len(seq.known)
                chunks.append(StepChunk(sid, start, seq.known[start:start + n], done, len(chunks)))
                seq.cached.extend(seq.known[start:start + n])
                seq.checked = len(seq.cached)
                left -= n
                if not done:
                    rest.append((sid, start + n))
            firsts.update(self._forward(chunks))
            pending = rest
        return firsts

    def _forward(self, chunks: list[StepChunk]) -> dict[int, int]:
        """One forward of the draft over ``chunks``: the argmax at each sampling one."""
        chunks.sort(key=lambda c: (len(c.tokens) != 1, c.start))   # decodes first (the backends' layout)
        step = self.batch.stage(chunks)
        meta = self.model.backend.prepare(self.batch.step_metadata(step))
        hidden = self.model(self.batch.region("input_ids", step.num_tokens),
                            self.batch.region("positions", step.num_tokens), meta, self.cache)
        if not step.num_sampled:
            return {}
        logits = self.model.compute_logits(hidden, self.batch.region("sample_tokens", step.num_sampled))
        tokens = logits.argmax(dim=-1).cpu().tolist()
        return dict(zip(step.sampled_seq_ids, (int(t) for t in tokens)))

    def step(self, plan: engine_pb2.StepPlan, chunks: Sequence[StepChunk], result: engine_pb2.StepResult) -> None:
        """After a step: follow its tokens, then propose what its plan asked for (into ``result``)."""
        self.observe(chunks, result)
        asked = [(c.seq_id, c.num_proposals) for c in plan.chunks if c.num_proposals]
        if not asked:
            return
        started = time.perf_counter()
        proposals = self.propose(asked)
        result.draft_seconds = time.perf_counter() - started   # (argmax copies synced the device)
        result.draft_proposed_tokens = sum(len(p.token_ids) for p in proposals)
        result.proposals.extend(proposals)


def check_same_vocabulary(target_path: str | None, draft_path: str, target: ModelFacts, draft: ModelFacts) -> None:
    """The draft must score the target's token ids: the same logits width and the
    same tokenizer (vocabulary and end-of-sequence ids); ``UnsupportedModelError`` if not."""
    if draft.vocab_size != target.vocab_size:
        raise UnsupportedModelError(f"draft model {draft_path}: its vocabulary has {draft.vocab_size} tokens, "
                                    f"the target's {target.vocab_size}: the draft must share the target's tokenizer")
    target_files, draft_files = resolve_model(target_path), resolve_model(draft_path)
    if target_files == draft_files:
        return
    mine, theirs = load_tokenizer(draft_files, cache_root()), load_tokenizer(target_files, cache_root())
    if mine.get_vocab() != theirs.get_vocab():
        different = sorted(set(mine.get_vocab().items()) ^ set(theirs.get_vocab().items()))[:3]
        raise UnsupportedModelError(f"draft model {draft_path}: its tokenizer differs from the target's "
                                    f"(e.g. {different}): the draft must share the target's tokenizer")
