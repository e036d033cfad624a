"""The model runner: the only code that touches the device.

It executes step plans exactly as given: checks the plan, applies its diffs
to the per-sequence state and the persistent batch (``input_batch.py``),
stages the step's inputs in one host-to-device copy, runs one forward over
the flattened tokens of all chunks (a captured CUDA graph for decode-only
steps on CUDA), and samples where the plan asks. The step's one host sync
is the copy of the sampled ids and logprobs (with their top logprobs).

Constrained steps: a plan with masked chunks is given a ``wait_for_masks``
callable; the runner launches the forward, then calls it with the step id
and applies the returned ``StepMasks`` (the scheduler computes them while
the forward runs). Prompt logprobs: for sequences that ask, the logits of
every prompt position of their chunks are computed too (after the sample)
and each prompt token is scored under the distribution before it; the
log-softmax row after a chunk's last prompt position is kept to score the
next chunk's first token.

Tensor parallelism (``parallel.py``): rank 0's runner broadcasts each plan
it executes, with the tokens it sampled since the last one, to the other
ranks; theirs execute it (``note_samples`` first) and skip the logits and
the sampling. Warm-up runs on rank 0 and reaches the others the same way.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from jitney.common.model_files import cache_root
from jitney.engine.v1 import engine_pb2
from jitney.worker.runner import lora_plan, speculative, tuned_configs
from jitney.worker.attention.backend import AttentionMetadata
from jitney.worker.attention.backends import make_attention_backend, prefill_block_q
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.draft_model import DraftModel
from jitney.worker.runner.cuda_graphs import DecodeGraphs, capture_sizes, mixed_buckets
from jitney.worker.runner.device import (ModelTimer, dtype_name, resolve_batch_invariant, resolve_device,
                                         resolve_dtype, skinny_rows, step_defaults, use_cpu_attention)
from jitney.worker.runner.input_batch import InputBatch, StagedStep, StepChunk
from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache, size_cache
from jitney.worker.loading.loader import load_model
from jitney.worker.layers.reduce import no_reduce
from jitney.worker.distributed.parallel import TensorParallelGroup
from jitney.worker.runner.plan_checks import (ChunkRow, PlanError, PlanLimits, SequenceState, apply_plan_diffs, chunk_rows,
                                chunk_tokens, validate_plan)
from jitney.worker.runner.sampler import log_softmax_rows, pack_results, sample_step, top_tokens
from jitney.worker.runner.warmup import profile_activations, warm_up
from jitney.worker.loading.weights_cache import WeightsCache

logger = logging.getLogger("jitney.worker")

# Given a step id, blocks until that step's StepMasks arrive and returns them.
MaskSource = Callable[[int], engine_pb2.StepMasks]


class MaskError(RuntimeError):
    """The masks of a step do not fit it (another step id, other sequences, a
    wrong size, or a mask that allows no token): a scheduler bug; the step fails."""


class _Draw(NamedTuple):
    """A step's samples on the host: ids and logprobs in plan order, and the
    top logprobs of the rows that asked, flattened (N each, plan order)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    kept: list[bool] = []     # after ``_verify``: which of the step's sampled rows these are


@dataclass(frozen=True)
class _PromptChunk:
    """A chunk whose prompt tokens are scored (``prompt_logprobs``).

    Logits are needed at positions ``[start, start + num_logits)`` (each
    scores the next token, or is kept for the next chunk); the tokens at
    ``[first_scored, end_scored)`` are scored, the first from the kept row
    of the chunk before when ``carry_in``.
    """

    seq_id: int
    plan_index: int
    start: int
    tokens: np.ndarray | list[int]
    flat_start: int          # index of the chunk's first token in the step's flattened tokens
    num_logits: int
    first_scored: int
    end_scored: int
    alternatives: int
    carry_in: bool
    keeps: bool              # the row after its last position scores the next chunk's first token


class ModelRunner:
    """Owns the model, the paged KV cache and the persistent batch.

    ``capture_graphs``: None = on CUDA with a graph-safe backend, without
    tensor parallelism (its all-reduces run eagerly); False runs every step
    eagerly; a ``DecodeGraphs`` may also be set afterwards (tests emulate
    graphs on the CPU that way). ``group``: this rank's tensor-parallel group
    (``parallel.init_group(config)``), needed when ``config.tp_size`` > 1.
    """

    def __init__(self, config: WorkerConfig, *, capture_graphs: bool | None = None,
                 group: TensorParallelGroup | None = None) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if (group.size if group is not None else 1) != config.tp_size:
            raise ValueError(f"tp_size {config.tp_size} needs its group (parallel.init_group)")
        self.config = config
        self.group = group
        self.samples = group is None or group.rank == 0     # only rank 0 computes logits and samples
        # Rank 0: (seq id, token) sampled since the last plan relayed to the other ranks.
        self._unrelayed: list[tuple[int, int]] = []
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config)
        self.batch_invariant = resolve_batch_invariant(config, self.device, self.dtype)
        use_cpu_attention(config, self.device, self.batch_invariant)
        cache = (WeightsCache(Path(config.weights_cache) if config.weights_cache else cache_root())
                 if config.use_weights_cache else None)
        self.model, self.facts = load_model(config.model, self.dtype, self.device, config.max_model_len,
                                            batch_invariant=self.batch_invariant,
                                            quantization=config.quantization, weights_cache=cache,
                                            shard=group.shard if group else None,
                                            reduce=group.all_reduce if group else no_reduce)
        loaded = time.perf_counter()
        cfg = self.model.config
        # The card's measured launch choices, if any, before any kernel is built or tile map sized.
        tuned_rows = tuned_configs.apply(self.device, (cfg.num_heads, cfg.num_kv_heads))
        backend = make_attention_backend(config.attention_backend, self.device, batch_invariant=self.batch_invariant)
        self.model.use_backend(backend, self.facts.context_length)
        self.lora = lora_plan.use_lora(self.model, config, self.implementation, self.dtype, self.device)
        self._lora_slot: dict[int, int] = {}   # seq id -> its adapter slot (absent: the base model)
        self.skinny_rows = skinny_rows(config, self.device, backend.graph_safe, self.batch_invariant, tuned_rows)
        if self.skinny_rows:
            from jitney.worker.kernels.triton.skinny import use_skinny_linears

            swapped = use_skinny_linears(self.model, self.skinny_rows)
            logger.info("skinny linears (steps of <= %d tokens): %s", self.skinny_rows,
                        ", ".join(f"{n}x{k}" for n, k in sorted(set(swapped))) or "none measured faster here")
        max_tokens, max_seqs = step_defaults(config, self.device)
        geometry = CacheGeometry(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        # The draft model's weights before the cache is sized (on CUDA it takes the memory left).
        self.draft = (DraftModel(config, self.facts, self.dtype, self.device, self.batch_invariant, cache)
                      if config.draft_model else None)
        reserve = profile_activations(self.model, geometry, self.device, max_tokens, max_seqs,
                                      self.facts.context_length)
        num_blocks = size_cache(geometry, self.device, num_blocks=config.num_blocks,
                                kv_cache_gib=config.kv_cache_gib, reserve_bytes=reserve.graphs)
        if self.draft is not None:
            num_blocks = self._share_with_draft(self.draft, geometry, num_blocks, max_tokens, max_seqs)
        if group is not None:   # every rank holds the same blocks (of its own KV heads)
            num_blocks = group.min_int(num_blocks)
        self.cache = PagedKVCache(geometry, num_blocks, self.device, backend.block_shapes(geometry))
        self.limits = PlanLimits(num_blocks=num_blocks, block_size=config.block_size,
                                 context_length=self.facts.context_length, vocab_size=self.facts.vocab_size,
                                 max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs)
        self.sequences: dict[int, SequenceState] = {}
        # Sequences with prompt_logprobs, and the log-softmax row (V,) after the last computed
        # prompt position of those whose prompt continues in a later chunk.
        self._scoring: set[int] = set()
        self._prompt_carry: dict[int, torch.Tensor] = {}
        # Chunks verifying drafts whose outcome this rank has not applied yet (ranks > 0
        # learn it from the tokens rank 0 relays with the next plan: ``note_samples``).
        self._unverified: dict[int, ChunkRow] = {}
        graph_safe = self.model.backend.graph_safe
        self._timer = ModelTimer(self.device)
        self.batch = InputBatch(max_num_seqs=max_seqs, max_num_tokens=max_tokens,
                                max_blocks_per_seq=self.limits.max_blocks_per_seq,
                                block_size=config.block_size, device=self.device, vocab_size=self.facts.vocab_size,
                                tile_block_q=prefill_block_q(cfg.num_heads, cfg.num_kv_heads) if graph_safe else 0)
        if capture_graphs is None:
            # (transformers' modeling code is not known to be capture-safe: it runs eagerly)
            capture_graphs = self.device.type == "cuda" and graph_safe and group is None and cfg.family != "transformers"
        self.graphs = (DecodeGraphs(self.model, self.cache, self.batch, capture_sizes(max_seqs),
                                    mixed_tokens=mixed_buckets(max_tokens))
                       if capture_graphs else None)
        if self.samples:   # the other ranks run rank 0's warm-up plans, relayed
            warm_up(self)
        self.warmup_seconds = time.perf_counter() - loaded
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s); step budget %d tokens, %d seats; "
            "activations %.2f GiB, CUDA graphs %.2f GiB reserved (%.2f GiB captured); warm-up %.1f s",
            num_blocks, config.block_size, self.cache.nbytes / 2**30, dtype_name(self.dtype), max_tokens, max_seqs,
            reserve.activations / 2**30, reserve.graphs / 2**30,
            (self.graphs.pool_bytes if self.graphs else 0) / 2**30, self.warmup_seconds,
        )

    def _share_with_draft(self, draft: DraftModel, geometry: CacheGeometry, num_blocks: int, max_tokens: int,
                          max_seqs: int) -> int:
        """The draft's cache gets ``--draft-num-blocks`` blocks, else as many as the
        target's; a cache sized from the card's free memory (no size flag) is shared
        between the two so that both fit. The target's block count is returned."""
        config = self.config
        if config.num_blocks is None and config.kv_cache_gib is None and self.device.type == "cuda":
            target, other = geometry.bytes_per_block(), draft.geometry.bytes_per_block()
            spare = (config.draft_num_blocks or 0) * other
            num_blocks = max(1, (num_blocks * target - spare) // (target + (0 if config.draft_num_blocks else other)))
        draft.reserve_blocks(config.draft_num_blocks or num_blocks, max_tokens, max_seqs)
        return num_blocks

    def ready_message(self) -> engine_pb2.Ready:
        """The handshake: model facts, cache geometry and the step limits."""
        return engine_pb2.Ready(
            protocol_version=engine_pb2.PROTOCOL_VERSION_2,
            model_name=self.facts.name,
            vocab_size=self.facts.vocab_size,
            context_length=self.facts.context_length,
            eos_token_ids=list(self.facts.eos_token_ids),
            num_blocks=self.limits.num_blocks,
            block_size=self.limits.block_size,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            worker_pid=os.getpid(),
            max_num_seqs=self.limits.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            warmup_seconds=self.warmup_seconds,
            batch_invariant=self.batch_invariant,
            tensor_parallel_size=self.config.tp_size,
            quantization=self.config.quantization,
            model_implementation=self.implementation,
            batch_invariance_guaranteed=self.batch_invariant and self.implementation == "native",
            sliding_window=self.sliding_window,
            draft_model=self.draft.facts.name if self.draft is not None else "",
            draft_num_blocks=self.draft.num_blocks if self.draft is not None else 0,
            **lora_plan.ready_fields(self.lora),
        )

    @property
    def sliding_window(self) -> int:
        """The largest of the layers' windows when every layer has one (the
        scheduler then releases blocks before it), else 0."""
        layers = getattr(getattr(self.model, "model", None), "layers", None) or []
        windows = [int(getattr(layer, "attend", {}).get("window") or 0) for layer in layers]
        return max(windows) if windows and all(windows) else 0

    @property
    def implementation(self) -> str:
        """Which code runs the model: "native" (a Jitney family) or "transformers" (the fallback)."""
        return "transformers" if self.model.config.family == "transformers" else "native"

    @torch.inference_mode()
    def execute(self, plan: engine_pb2.StepPlan, wait_for_masks: MaskSource | None = None) -> engine_pb2.StepResult:
        """Run one step. Raises ``PlanError`` (state untouched) on a bad plan,
        ``MaskError`` on masks that do not fit it.

        A ``reset`` plan is checked and applied as if no sequence were known:
        the runner forgets every sequence first (after a failed step).
        ``wait_for_masks``: needed by a plan with masked chunks; called once,
        with the step id, after the forward was launched (see ``MaskSource``).
        """
        if self.group is not None and self.group.rank == 0:
            self._relay(plan)
        rows = chunk_rows(plan)
        new_states = validate_plan(plan, {} if plan.reset else self.sequences, self.limits, rows)
        masked = [r.seq_id for r in rows if r.masked]
        if masked and wait_for_masks is None and self.samples:   # (the other ranks never read masks)
            raise PlanError(f"step {plan.step_id}: masked chunks, but no masks to wait for")
        if self.draft is not None:
            self.draft.check_plan(plan)
        elif any(c.num_proposals for c in plan.chunks) or any(n.draft_context_token_ids for n in plan.new_sequences):
            raise PlanError(f"step {plan.step_id}: draft model fields, but this worker runs no draft model")
        lora_plan.check_plan(plan, self.lora)
        if plan.reset:
            self._forget_all()
        lora_plan.apply_loads(plan, self.lora)   # (before the diffs: a failed load changes no sequence)
        self._apply(plan, new_states, rows)
        result = engine_pb2.StepResult(step_id=plan.step_id)
        if rows:
            masking = (plan.step_id, masked, wait_for_masks) if masked and wait_for_masks is not None else None
            chunks = self._chunks(plan, rows)
            self._run(chunks, result, masking)
            if self.draft is not None:
                self.draft.step(plan, chunks, result)
        return result

    def _relay(self, plan: engine_pb2.StepPlan) -> None:
        """Rank 0: send ``plan`` to the other ranks, with what was sampled since the last one."""
        assert self.group is not None
        step = engine_pb2.RankStep(plan=plan, sampled_seq_ids=[s for s, _ in self._unrelayed],
                                   sampled_token_ids=[t for _, t in self._unrelayed])
        self._unrelayed.clear()
        self.group.send(engine_pb2.RankMessage(step=step))

    def note_samples(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """Ranks > 0: the tokens rank 0 sampled (relayed with the next plan)."""
        yielded: dict[int, int] = {}
        for seq_id, token in zip(seq_ids, tokens):
            state = self.sequences.get(seq_id)
            if state is not None:
                state.last_sampled = token
                yielded[seq_id] = yielded.get(seq_id, 0) + 1
        for seq_id, count in yielded.items():
            if (row := self._unverified.pop(seq_id, None)) is not None:
                speculative.roll_back(self.sequences[seq_id], self.batch, row, count - 1, self.limits.block_size)

    def _forget_all(self) -> None:
        """Drop every sequence, as if all were freed (the KV cache is left as it is)."""
        for sid in self.sequences:
            self.batch.remove(sid)
        for known in (self.sequences, self._lora_slot, self._prompt_carry, self._unverified):
            known.clear()
        self._scoring.clear()
        if self.draft is not None:
            self.draft.forget_all()

    def _apply(self, plan: engine_pb2.StepPlan, new_states: dict[int, SequenceState], rows: list[ChunkRow]) -> None:
        """The plan's diffs (``new_states``: its new sequences' checked states; ``rows``: its
        ``chunk_rows``), to the sequence states and to the persistent batch's rows."""
        seqs = self.sequences
        # Positions computed before this step, per penalised chunk (a new sequence: its context tokens).
        computed = {n.seq_id: len(n.context_token_ids) for n in plan.new_sequences}
        if self.batch.any_penalised:
            for r in rows:
                if r.seq_id not in computed:
                    computed[r.seq_id] = seqs[r.seq_id].num_computed
        apply_plan_diffs(plan, seqs, new_states, rows)
        if self.draft is not None:
            self.draft.apply(plan)
        for sid in plan.freed_seq_ids:
            self.batch.remove(sid)
            self._scoring.discard(sid)
            self._prompt_carry.pop(sid, None)
            self._unverified.pop(sid, None)
            self._lora_slot.pop(sid, None)
        for new in plan.new_sequences:
            s = self.sequences[new.seq_id]
            self._lora_slot.update({new.seq_id: new.lora_slot} if new.lora_slot else {})
            self.batch.add(new.seq_id, s.temperature, s.top_p, s.top_k, s.seed, s.params)
            if new.context_token_ids:   # a cached or shared prefix: its tokens still count
                self.batch.count_context(new.seq_id, np.array(new.context_token_ids, dtype=np.int64))
            if s.params.prompt_logprobs is not None:
                self._scoring.add(new.seq_id)
        for r in rows:
            if r.num_drafts:
                self._unverified[r.seq_id] = r
            if r.num_blocks:
                self.batch.extend_blocks(r.seq_id, plan.chunks[r.plan_index].new_block_ids)
            if seqs[r.seq_id].params.penalised and r.start != computed[r.seq_id]:
                # Counts are built from the tokens the worker computes: those before are not seen.
                logger.warning("seq %d: penalties do not count the %d positions before %d (a cached prefix?)",
                               r.seq_id, r.start - computed[r.seq_id], r.start)

    def _chunks(self, plan: engine_pb2.StepPlan, rows: list[ChunkRow]) -> list[StepChunk]:
        """The plan's chunks, decodes first; on the CPU also shortest context first (its
        attention backend batches decodes in runs of similar length)."""
        seqs = self.sequences
        chunks = [StepChunk(r.seq_id, r.start,
                            [_last_sampled(seqs[r.seq_id])] if not r.num_ids   # (a decode of the sampled token)
                            else chunk_tokens(plan.chunks[r.plan_index], seqs[r.seq_id]), r.sample, r.plan_index,
                            r.num_drafts)
                  for r in rows]
        if self.device.type == "cpu":
            chunks.sort(key=_decodes_first)
        elif not all(len(c.tokens) == 1 for c in chunks):
            chunks.sort(key=_not_a_decode)   # (stable: plan order within each part)
        return chunks

    def _run(self, chunks: list[StepChunk], result: engine_pb2.StepResult,
             masking: tuple[int, list[int], MaskSource] | None = None) -> None:
        if not self.samples:
            self._forward_only(chunks)
            return
        lora_slots = lora_plan.token_slots(chunks, self._lora_slot, self.device)
        graphs = self.graphs if lora_slots is None else None   # (graphs are captured without adapters)
        prompt = self._prompt_chunks(chunks)
        # Prompt logprobs need the hidden states, which a decode graph does not return.
        size = graphs.size_for(chunks) if graphs is not None and not prompt else None
        bucket = graphs.mixed_bucket(sum(len(c.tokens) for c in chunks)) if graphs is not None and size is None else None
        if bucket is not None:
            step = self.batch.stage(chunks, pad_seqs_to=self.batch.max_num_seqs, pad_tokens_to=bucket)
        else:
            step = self.batch.stage(chunks, pad_seqs_to=size or 0)
        # Attention metadata (and the CPU backend's plan) before the model's clock starts.
        meta = self.model.backend.prepare(self.batch.step_metadata(step)) if size is None and bucket is None else None
        meta = replace(meta, lora_slots=lora_slots) if meta is not None and lora_slots is not None else meta
        timer = self._timer
        timer.start()
        plain_greedy = (step.num_plain == step.num_filtered == 0 and not step.processed
                        and not step.top_n.any() and masking is None)
        if graphs is not None and size is not None and plain_greedy:
            _, greedy = graphs.logits(size)   # every row greedy, unprocessed: the graph's own choice is the result
            timer.stop()
            # The (2, size) choices come back whole (a few KB): the sampled rows are picked on the host.
            tokens, logprobs = _unpack(greedy.cpu().numpy()[:, step.sample_tokens])
            self._record(step.sampled_seq_ids, tokens, logprobs, result)   # (a decode graph: no drafts)
        else:
            hidden, logits = self._logits(step, size, bucket, meta)
            timer.stop()
            if logits is not None:
                masks = self._read_masks(step, *masking) if masking is not None else None
                # (Called with two arguments when unmasked: tests wrap ``_sample`` so.)
                drawn = self._sample(step, logits, masks) if masks is not None else self._sample(step, logits)
                if self._unverified:
                    drawn = self._verify(step, chunks, drawn)
                    seq_ids = [sid for sid, keep in zip(step.sampled_seq_ids, drawn.kept) if keep]
                else:
                    seq_ids = step.sampled_seq_ids
                self._record(seq_ids, drawn.tokens, drawn.logprobs, result)
                result.top_token_ids.extend(drawn.top_ids)
                result.top_logprobs.extend(drawn.top_logprobs)
            else:   # nothing samples: no other sync
                timer.sync()
            if prompt:
                assert hidden is not None
                self._prompt_logprobs(hidden, prompt, result)
        result.model_seconds = timer.seconds()

    def _forward_only(self, chunks: list[StepChunk]) -> None:
        """A rank > 0's step: the forward (its K/V written, its share of every all-reduce)."""
        step = self.batch.stage(chunks)
        meta = self.model.backend.prepare(self.batch.step_metadata(step))
        self.model(self.batch.region("input_ids", step.num_tokens),
                   self.batch.region("positions", step.num_tokens), meta, self.cache)

    def _logits(self, step: StagedStep, size: int | None, bucket: int | None,
                meta: AttentionMetadata | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward (a decode graph, a mixed graph, or eagerly) -> the hidden states
        (None from a decode graph) and the float32 logits of the sampled rows."""
        sampled = self.batch.region("sample_tokens", step.num_sampled) if step.num_sampled else None
        if size is not None:
            assert self.graphs is not None
            logits, _ = self.graphs.logits(size)
            return None, logits.index_select(0, sampled) if sampled is not None else None
        if bucket is not None:
            assert self.graphs is not None
            hidden = self.graphs.mixed_hidden(bucket)
        else:
            assert meta is not None
            hidden = self.model(self.batch.region("input_ids", step.num_tokens),
                                self.batch.region("positions", step.num_tokens), meta, self.cache)
        return hidden, self.model.compute_logits(hidden, sampled) if sampled is not None else None

    def _read_masks(self, step: StagedStep, step_id: int, masked: list[int],
                    wait_for_masks: MaskSource) -> tuple[np.ndarray, np.ndarray]:
        """Wait for the step's masks and check them: (the masked rows, as
        indices into the sampled rows; their bitmask words (M, ceil(V / 32)))."""
        message = wait_for_masks(step_id)
        if message.step_id != step_id:
            raise MaskError(f"masks for step {message.step_id} while step {step_id} waits for its own")
        if list(message.seq_ids) != masked:
            raise MaskError(f"masks for seqs {list(message.seq_ids)}, the step's masked chunks are {masked}")
        vocab = self.limits.vocab_size
        width = -(-vocab // 32)
        if len(message.bitmask) != len(masked) * width * 4:
            raise MaskError(f"{len(message.bitmask)} mask bytes, {len(masked)} masks of {width} words expected")
        words = np.frombuffer(message.bitmask, dtype="<i4").astype(np.int32).reshape(len(masked), width)
        if vocab % 32:   # bits past the vocabulary allow nothing
            words[:, -1] &= np.int32((1 << (vocab % 32)) - 1)
        empty = np.flatnonzero(~words.any(axis=1))
        if len(empty):
            raise MaskError(f"the mask of seq {masked[empty[0]]} allows no token")
        where = {sid: i for i, sid in enumerate(step.sampled_seq_ids)}
        return np.array([where[sid] for sid in masked], dtype=np.int64), words

    def _sample(self, step: StagedStep, logits: torch.Tensor,
                masks: tuple[np.ndarray, np.ndarray] | None = None) -> _Draw:
        """Sample the step's rows (processors, masks, top logprobs); the result on the host."""
        _, params, groups = self.batch.sampling(step)
        processors = self.batch.processors(step, masks)
        top_index = np.flatnonzero(step.top_n)
        top_n = int(step.top_n.max()) if len(top_index) else 0
        top_rows = torch.from_numpy(top_index).to(self.device) if top_n else None
        drawn = sample_step(logits, params, groups, processors=processors, top_rows=top_rows, top_n=top_n)
        packed = pack_results(drawn.tokens, drawn.logprobs)
        if drawn.top_ids is None or drawn.top_logprobs is None:
            return _Draw(*_unpack(packed.cpu()))
        # One copy back: the (2, S) ids and logprobs, then the (R, n) top ids and logprobs.
        s, width = step.num_sampled, drawn.top_ids.shape[1]
        host = torch.cat((packed.flatten(), drawn.top_ids.double().flatten(),
                          drawn.top_logprobs.double().flatten())).cpu().numpy()
        top_ids = host[2 * s:2 * s + len(top_index) * width].reshape(len(top_index), width)
        top_lps = host[2 * s + len(top_index) * width:].reshape(len(top_index), width)
        counts = step.top_n[top_index].tolist()   # each row's own N, flattened in plan order
        return _Draw([int(t) for t in host[:s]], host[s:2 * s].tolist(),
                     [int(t) for i, n in enumerate(counts) for t in top_ids[i, :n]],
                     [float(v) for i, n in enumerate(counts) for v in top_lps[i, :n]])

    def _verify(self, step: StagedStep, chunks: list[StepChunk], drawn: _Draw) -> _Draw:
        """The verifying chunks' outcome (``speculative``): the kept rows' draw
        (``kept``: which of the S rows), their sequences rolled back."""
        kept, accepted = speculative.verify(step, chunks, drawn.tokens)
        for seq_id, (n, drafts) in accepted.items():
            speculative.roll_back(self.sequences[seq_id], self.batch, self._unverified.pop(seq_id), n,
                                  self.limits.block_size, drafts[n:])
        return _Draw(*speculative.kept_rows(step, kept, *drawn[:4]), kept)

    def _record(self, seq_ids: list[int], tokens: list[int], logprobs: list[float],
                result: engine_pb2.StepResult) -> None:
        for seq_id, token in zip(seq_ids, tokens):
            self.sequences[seq_id].last_sampled = token
        if self.group is not None:
            self._unrelayed.extend(zip(seq_ids, tokens))
        result.seq_ids.extend(seq_ids)
        result.token_ids.extend(tokens)
        result.logprobs.extend(logprobs)

    # -- prompt logprobs -----------------------------------------------------

    def _prompt_chunks(self, chunks: list[StepChunk]) -> list[_PromptChunk]:
        """The step's chunks (step order) with prompt tokens to score or a row to keep."""
        work: list[_PromptChunk] = []
        if not self._scoring:
            return work
        flat = 0
        for c in chunks:
            params = self.sequences[c.seq_id].params
            start, end, npt = c.start, c.start + len(c.tokens), params.num_prompt_tokens
            if params.prompt_logprobs is not None and start < npt:
                num_logits = max(0, min(end, npt - 1) - start)
                first, end_scored = max(1, start), min(end, npt)
                if num_logits or first < end_scored:
                    work.append(_PromptChunk(
                        c.seq_id, c.plan_index, start, c.tokens, flat, num_logits, first, end_scored,
                        params.prompt_logprobs, carry_in=start > 0, keeps=end < npt))
            flat += len(c.tokens)
        return work

    def _prompt_logprobs(self, hidden: torch.Tensor, work: list[_PromptChunk],
                         result: engine_pb2.StepResult) -> None:
        """Score the prompt tokens of ``work``'s chunks under the raw distribution, in one
        batched program: the logits of their positions, their log-softmax rows after the
        kept rows of the chunks before, one gather of the scored tokens and their top-N."""
        device = self.device
        positions = np.concatenate([np.arange(w.flat_start, w.flat_start + w.num_logits) for w in work])
        carried = [w for w in work if w.carry_in]
        rows = [self._prompt_carry[w.seq_id][None] for w in carried]
        if len(positions):
            logits = self.model.compute_logits(hidden, torch.from_numpy(positions).to(device))
            rows.append(log_softmax_rows(logits))
        table = torch.cat(rows)   # (carried + positions, V): kept rows first
        # Row of the distribution each scored token is read from, and the token.
        carry_row = {w.seq_id: i for i, w in enumerate(carried)}
        source, target, offset = [], [], len(carried)
        for w in work:
            for q in range(w.first_scored, w.end_scored):
                source.append(carry_row[w.seq_id] if q == w.start else offset + q - 1 - w.start)
                target.append(w.tokens[q - w.start])
            if w.keeps:   # the row after its last position scores the next chunk's first token
                self._prompt_carry[w.seq_id] = table[offset + w.num_logits - 1].clone()
            else:   # its prompt is scored
                self._prompt_carry.pop(w.seq_id, None)
                self._scoring.discard(w.seq_id)
            offset += w.num_logits
        src = torch.tensor(source, dtype=torch.int64, device=device)
        scored = table[src]
        parts = [scored.gather(-1, torch.tensor(target, dtype=torch.int64, device=device)[:, None]).squeeze(-1)]
        width = min(max(w.alternatives for w in work), self.limits.vocab_size)
        if width and len(source):
            ids = top_tokens(scored, width)
            parts += [ids.flatten().double(), scored.gather(-1, ids).flatten()]
        host = torch.cat([p.double() for p in parts]).cpu().numpy()
        count = len(source)
        logprobs, top = host[:count], host[count:]
        top_ids = top[:count * width].reshape(count, width)
        top_lps = top[count * width:].reshape(count, width)
        # Each chunk's scored tokens are contiguous in ``source``; entries follow the plan's order.
        starts, at = {}, 0
        for w in work:
            starts[w.seq_id] = at
            at += w.end_scored - w.first_scored
        for w in sorted(work, key=lambda w: w.plan_index):
            n = w.end_scored - w.first_scored
            if not n:
                continue
            i = starts[w.seq_id]
            entry = result.prompt_logprobs.add(seq_id=w.seq_id, start_position=w.first_scored,
                                               token_ids=w.tokens[w.first_scored - w.start:w.end_scored - w.start],
                                               logprobs=logprobs[i:i + n].tolist())
            if w.alternatives:
                entry.top_token_ids.extend(int(t) for t in top_ids[i:i + n, :w.alternatives].flatten())
                entry.top_logprobs.extend(top_lps[i:i + n, :w.alternatives].flatten().tolist())


def _decodes_first(chunk: StepChunk) -> tuple[bool, int]:
    return len(chunk.tokens) != 1, chunk.start


def _last_sampled(state: SequenceState) -> int:
    assert state.last_sampled is not None   # checked by validate_plan
    return state.last_sampled


def _not_a_decode(chunk: StepChunk) -> bool:
    return len(chunk.tokens) != 1


def _unpack(packed: torch.Tensor | np.ndarray) -> tuple[list[int], list[float]]:
    """``pack_results``' (2, S) float64, copied to the host -> token ids, logprobs."""
    return [int(t) for t in packed[0].tolist()], packed[1].tolist()
