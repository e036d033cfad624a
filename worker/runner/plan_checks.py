"""Per-sequence worker state and the strict checking of step plans.

A plan is checked as a whole against the state *before* anything is
applied, so a rejected plan leaves the worker exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from jitney.engine.v1 import engine_pb2


class PlanError(ValueError):
    """A step plan the worker refuses to execute (a scheduler bug)."""


@dataclass(frozen=True)
class PlanLimits:
    """What a plan must fit in: cache geometry, model and step budget."""

    num_blocks: int
    block_size: int
    context_length: int
    vocab_size: int
    max_num_batched_tokens: int
    max_num_seqs: int

    @property
    def max_blocks_per_seq(self) -> int:
        """The blocks a sequence's table can hold: enough for the context length."""
        return -(-self.context_length // self.block_size)


@dataclass(frozen=True)
class ProcessorParams:
    """A sequence's sampling parameters beyond temperature, top-p, top-k and
    seed (see ``sampler.py`` for what each does): the logits processors,
    min-p, and the logprobs it asks for. The defaults change nothing."""

    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    min_tokens: int = 0
    min_tokens_banned_ids: tuple[int, ...] = ()   # sorted, unique
    top_logprobs: int = 0
    prompt_logprobs: int | None = None    # None: none asked for; else the alternatives per position
    num_prompt_tokens: int = 0            # positions before this are the prompt

    @property
    def penalised(self) -> bool:
        """Whether the sequence needs token counts (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def bans_at(self, position: int) -> bool:
        """Whether min_tokens bans its ids for the token sampled at ``position``."""
        return bool(self.min_tokens_banned_ids) and position - self.num_prompt_tokens < self.min_tokens


NO_PROCESSORS = ProcessorParams()


@dataclass
class SequenceState:
    """What the worker remembers about one sequence between steps."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    block_table: list[int] = field(default_factory=list)
    last_sampled: int | None = None   # the token sampled in this sequence's latest step
    params: ProcessorParams = NO_PROCESSORS
    # Positions computed so far (the next chunk's start when none are skipped);
    # penalties and prompt logprobs need every position from 0.
    num_computed: int = 0


class ChunkRow(NamedTuple):
    """A scheduled chunk's scalar fields, read from the message once (``chunk_rows``):
    reading a protobuf field costs a fraction of a microsecond, and a step of 256
    decodes would read each several times over."""

    plan_index: int     # in plan.chunks
    seq_id: int
    start: int          # start_position
    num_ids: int        # len(token_ids)
    from_sample: bool   # last_token_from_sample
    num_blocks: int     # len(new_block_ids)
    sample: bool
    masked: bool
    num_drafts: int = 0  # num_draft_tokens: the chunk's last ids are drafts to verify


def chunk_rows(plan: engine_pb2.StepPlan) -> list[ChunkRow]:
    return [ChunkRow(i, c.seq_id, c.start_position, len(c.token_ids), c.last_token_from_sample,
                     len(c.new_block_ids), c.sample, c.masked, c.num_draft_tokens) for i, c in enumerate(plan.chunks)]


def accept_drafts(state: SequenceState, row: ChunkRow, accepted: int, block_size: int) -> list[int]:
    """A verified chunk's outcome on the sequence's state: computed up to the
    last non-draft token and the ``accepted`` drafts, the block table cut to
    the blocks those positions need (the scheduler frees the others: their
    ids are returned). The caller sets ``last_sampled``."""
    end = row.start + row.num_ids + row.from_sample - row.num_drafts + accepted
    state.num_computed = end
    keep = -(-end // block_size)
    dropped = state.block_table[keep:]
    del state.block_table[keep:]
    return dropped


def chunk_tokens(chunk: engine_pb2.ScheduledChunk, state: SequenceState) -> np.ndarray | list[int]:
    """The token ids a chunk computes, its sampled placeholder filled in: a list of
    ints for a short chunk (a decode), else an int64 array (one copy in C, not a list
    of boxed ints)."""
    ids = chunk.token_ids
    sampled = []
    if chunk.last_token_from_sample:
        assert state.last_sampled is not None  # checked by validate_plan
        sampled.append(state.last_sampled)
    if len(ids) <= _SHORT:
        return [*ids, *sampled]
    tokens = np.array(ids, dtype=np.int64)
    return np.append(tokens, sampled) if sampled else tokens


def sequence_state(seq: engine_pb2.NewSequence) -> SequenceState:
    """Fresh state for a new sequence, its sampling parameters checked (those
    that need the model's limits are checked by ``check_sampling_limits``)."""
    s = seq.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise PlanError(f"seq {seq.seq_id}: temperature must be finite and >= 0, got {s.temperature}")
    # proto3 cannot tell an unset top_p from 0: read 0 as "off" (1.0).
    top_p = 1.0 if s.top_p == 0 else s.top_p
    if not (0 < top_p <= 1):
        raise PlanError(f"seq {seq.seq_id}: top_p must be in (0, 1], got {s.top_p}")
    return SequenceState(temperature=s.temperature, top_p=top_p, top_k=s.top_k, seed=s.seed,
                         params=processor_params(seq))


def processor_params(seq: engine_pb2.NewSequence) -> ProcessorParams:
    """The sequence's ``ProcessorParams``, checked for nonsense (``PlanError``)."""
    s, sid = seq.sampling, seq.seq_id
    if not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
        raise PlanError(f"seq {sid}: min_p must be in [0, 1], got {s.min_p}")
    # 0 on the wire is "unset": no repetition penalty (1).
    repetition = 1.0 if s.repetition_penalty == 0 else s.repetition_penalty
    if not (math.isfinite(repetition) and repetition > 0):
        raise PlanError(f"seq {sid}: repetition_penalty must be finite and > 0, got {s.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(s, name)):
            raise PlanError(f"seq {sid}: {name} must be finite, got {getattr(s, name)}")
    bias_ids, bias_values = tuple(s.logit_bias_ids), tuple(s.logit_bias_values)
    if len(bias_ids) != len(bias_values):
        raise PlanError(f"seq {sid}: {len(bias_ids)} logit_bias ids but {len(bias_values)} values")
    if len(set(bias_ids)) != len(bias_ids):
        raise PlanError(f"seq {sid}: a logit_bias token id is given twice")
    if not all(math.isfinite(v) for v in bias_values):
        raise PlanError(f"seq {sid}: logit_bias values must be finite")
    params = ProcessorParams(   # + 0.0: a -0.0 penalty is +0.0 (``x - 0.0 * n`` keeps every x's bits)
        min_p=s.min_p, repetition_penalty=repetition, presence_penalty=s.presence_penalty + 0.0,
        frequency_penalty=s.frequency_penalty + 0.0, logit_bias_ids=bias_ids, logit_bias_values=bias_values,
        min_tokens=s.min_tokens, min_tokens_banned_ids=tuple(sorted(set(s.min_tokens_banned_ids))),
        top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        num_prompt_tokens=s.num_prompt_tokens,
    )
    # These count from the end of the prompt: a sequence using them must say where it is.
    uses_prompt_end = (params.presence_penalty or params.frequency_penalty or params.min_tokens
                       or params.prompt_logprobs is not None)
    if uses_prompt_end and params.num_prompt_tokens < 1:
        raise PlanError(f"seq {sid}: num_prompt_tokens must be set (>= 1) with presence/frequency penalties, "
                        "min_tokens or prompt_logprobs")
    return params


def check_sampling_limits(seq: engine_pb2.NewSequence, params: ProcessorParams, limits: PlanLimits) -> None:
    """The parameters that must fit the model: token ids, logprob counts, the prompt's length."""
    sid, vocab = seq.seq_id, limits.vocab_size
    for name, ids in (("logit_bias", params.logit_bias_ids), ("min_tokens_banned_ids", params.min_tokens_banned_ids)):
        if ids and max(ids) >= vocab:
            raise PlanError(f"seq {sid}: {name} token id {max(ids)} outside vocab of {vocab}")
    if params.min_tokens and len(params.min_tokens_banned_ids) >= vocab:
        raise PlanError(f"seq {sid}: min_tokens bans every token of the vocabulary")
    for name, n in (("top_logprobs", params.top_logprobs), ("prompt_logprobs", params.prompt_logprobs or 0)):
        if n > vocab:
            raise PlanError(f"seq {sid}: {name} {n} exceeds the vocab of {vocab}")
    if params.num_prompt_tokens > limits.context_length:
        raise PlanError(f"seq {sid}: num_prompt_tokens {params.num_prompt_tokens} exceeds "
                        f"the context length {limits.context_length}")
    context = seq.context_token_ids
    if context and not params.penalised:
        raise PlanError(f"seq {sid}: context_token_ids for a sequence without penalties")
    if context and max(context) >= vocab:
        raise PlanError(f"seq {sid}: context token id {max(context)} outside vocab of {vocab}")
    if len(context) >= limits.context_length:
        raise PlanError(f"seq {sid}: {len(context)} context tokens exceed the context length")


def validate_plan(plan: engine_pb2.StepPlan, seqs: Mapping[int, SequenceState],
                  limits: PlanLimits, rows: list[ChunkRow] | None = None) -> dict[int, SequenceState]:
    """Raise ``PlanError`` if ``plan`` cannot be applied to ``seqs``; else return
    the fresh states of its new sequences (``apply_plan_diffs`` may take them).
    ``rows``: the plan's ``chunk_rows``, if the caller has them."""
    prefix = f"step {plan.step_id}: "
    if rows is None:
        rows = chunk_rows(plan)
    try:
        table_lens, new_states = _check_diffs(plan, seqs, limits)
        if len(table_lens) > limits.max_num_seqs:
            raise PlanError(f"{len(table_lens)} live sequences exceed max_num_seqs {limits.max_num_seqs}")
        if not _chunks_pass(plan, rows, table_lens, limits, seqs):
            _check_chunks(plan, table_lens, limits, seqs)   # raises the first error, as it reads
        _check_history(plan, rows, seqs, {sid: state.params for sid, state in new_states.items()})
    except PlanError as err:
        raise PlanError(prefix + str(err)) from None
    return new_states


def _check_diffs(plan: engine_pb2.StepPlan, seqs: Mapping[int, SequenceState],
                 limits: PlanLimits) -> tuple[dict[int, int], dict[int, SequenceState]]:
    """Check freed and new sequences; return the block-table length of each
    live one, and the states of the new ones."""
    freed = list(plan.freed_seq_ids)
    if len(set(freed)) != len(freed):
        raise PlanError("a seq_id is freed twice")
    unknown = [s for s in freed if s not in seqs]
    if unknown:
        raise PlanError(f"freed unknown seq_id {unknown[0]}")
    gone = set(freed)
    table_lens = {sid: len(state.block_table) for sid, state in seqs.items() if sid not in gone}
    states = {}
    for new in plan.new_sequences:
        if new.seq_id in table_lens:
            raise PlanError(f"new sequence {new.seq_id} is already known")
        states[new.seq_id] = sequence_state(new)  # raises on bad sampling parameters
        check_sampling_limits(new, states[new.seq_id].params, limits)
        table_lens[new.seq_id] = 0
    return table_lens, states


# A chunk of up to this many token ids is read as Python ints (a decode's one id); longer ones
# through numpy in one copy (a prompt's ids would be boxed one by one).
_SHORT = 16


def _max_id(ids: Sequence[int]) -> int:
    return max(ids) if len(ids) <= _SHORT else int(np.array(ids).max())


def _chunks_pass(plan: engine_pb2.StepPlan, rows: list[ChunkRow], table_lens: dict[int, int],
                 limits: PlanLimits, seqs: Mapping[int, SequenceState]) -> bool:
    """Whether every chunk passes ``_check_chunks``' checks, in one pass over the plan's
    ``rows`` (a step of 256 decodes is checked in a fraction of the per-chunk walk). False
    leaves the verdict, and the error's message, to ``_check_chunks``."""
    if len(rows) > limits.max_num_seqs:
        return False
    chunks = plan.chunks
    new_ids = {s.seq_id for s in plan.new_sequences}
    total, seen = 0, set()
    bs, context, max_blocks = limits.block_size, limits.context_length, limits.max_blocks_per_seq
    for index, sid, start, num_ids, from_sample, num_blocks, sample, masked, num_drafts in rows:
        table_len = table_lens.get(sid)
        if table_len is None or sid in seen or (masked and not sample):
            return False
        if num_drafts and (not sample or masked or num_drafts >= num_ids + from_sample):
            return False
        seen.add(sid)
        if from_sample:
            state = seqs.get(sid)
            if sid in new_ids or state is None or state.last_sampled is None:
                return False
        num_tokens = num_ids + from_sample
        end = start + num_tokens
        if not num_tokens or end > context or end > (table_len + num_blocks) * bs or table_len + num_blocks > max_blocks:
            return False
        if num_ids and _max_id(chunks[index].token_ids) >= limits.vocab_size:
            return False
        if num_blocks and _max_id(chunks[index].new_block_ids) >= limits.num_blocks:
            return False
        total += num_tokens
    return total <= limits.max_num_batched_tokens


def _check_chunks(plan: engine_pb2.StepPlan, table_lens: dict[int, int], limits: PlanLimits,
                  seqs: Mapping[int, SequenceState]) -> None:
    if len(plan.chunks) > limits.max_num_seqs:
        raise PlanError(f"{len(plan.chunks)} chunks exceed max_num_seqs {limits.max_num_seqs}")
    new_ids = {n.seq_id for n in plan.new_sequences}
    total = 0
    for chunk in plan.chunks:
        if chunk.masked and not chunk.sample:
            raise PlanError(f"seq {chunk.seq_id}: a masked chunk must sample")
        drafts = chunk.num_draft_tokens
        if drafts and not chunk.sample:
            raise PlanError(f"seq {chunk.seq_id}: a chunk with drafts must sample")
        if drafts and chunk.masked:
            raise PlanError(f"seq {chunk.seq_id}: drafts under a grammar mask are not verified")
        if drafts and drafts >= len(chunk.token_ids) + chunk.last_token_from_sample:
            raise PlanError(f"seq {chunk.seq_id}: {drafts} drafts leave no token before them in a chunk of "
                            f"{len(chunk.token_ids) + chunk.last_token_from_sample}")
        from_sample = chunk.last_token_from_sample
        if from_sample and (chunk.seq_id in new_ids or chunk.seq_id not in seqs
                            or seqs[chunk.seq_id].last_sampled is None):
            raise PlanError(f"seq {chunk.seq_id}: last_token_from_sample but nothing was sampled for it")
        total += len(chunk.token_ids) + from_sample
    if total > limits.max_num_batched_tokens:
        raise PlanError(f"{total} tokens exceed max_num_batched_tokens {limits.max_num_batched_tokens}")
    seen: set[int] = set()
    for chunk in plan.chunks:
        sid = chunk.seq_id
        if sid not in table_lens:
            raise PlanError(f"chunk for unknown seq_id {sid}")
        if sid in seen:
            raise PlanError(f"seq {sid} has two chunks in one step")
        seen.add(sid)
        _check_chunk(chunk, table_lens[sid], limits)


def _check_chunk(chunk: engine_pb2.ScheduledChunk, table_len: int, limits: PlanLimits) -> None:
    sid, token_ids, block_ids = chunk.seq_id, chunk.token_ids, chunk.new_block_ids
    num_tokens = len(token_ids) + chunk.last_token_from_sample
    if not num_tokens:
        raise PlanError(f"seq {sid}: chunk has no token_ids")
    if token_ids:
        top = _max_id(token_ids)
        if top >= limits.vocab_size:
            raise PlanError(f"seq {sid}: token id {top} outside vocab of {limits.vocab_size}")
    if block_ids and max(block_ids) >= limits.num_blocks:
        bad = next(b for b in block_ids if b >= limits.num_blocks)
        raise PlanError(f"seq {sid}: block id {bad} out of range (num_blocks {limits.num_blocks})")
    end = chunk.start_position + num_tokens
    if end > limits.context_length:
        raise PlanError(f"seq {sid}: positions up to {end} exceed context length {limits.context_length}")
    capacity = (table_len + len(block_ids)) * limits.block_size
    if end > capacity:
        raise PlanError(f"seq {sid}: positions up to {end} exceed its block table capacity {capacity}")
    max_blocks = limits.max_blocks_per_seq
    if table_len + len(block_ids) > max_blocks:
        raise PlanError(f"seq {sid}: a block table of {table_len + len(block_ids)} blocks exceeds the {max_blocks} "
                        f"that the context length {limits.context_length} needs")


def _check_history(plan: engine_pb2.StepPlan, rows: list[ChunkRow], seqs: Mapping[int, SequenceState],
                   new_params: dict[int, ProcessorParams]) -> None:
    """Prompt logprobs score every prompt token from the one before it: such a
    sequence's chunks must follow each other from position 0 (the scheduler
    reads no cached prefix for it). A new sequence's context tokens are the
    positions before its first chunk, exactly."""
    context = {n.seq_id: len(n.context_token_ids) for n in plan.new_sequences if n.context_token_ids}
    if context:   # (most plans have none)
        for chunk in plan.chunks:
            if chunk.seq_id in context and context.pop(chunk.seq_id) != chunk.start_position:
                raise PlanError(f"seq {chunk.seq_id}: context_token_ids must cover the positions before its "
                                f"first chunk at {chunk.start_position}")
        if context:
            raise PlanError(f"seq {next(iter(context))}: context_token_ids but no chunk in the plan")
    for row in rows:
        sid = row.seq_id
        if sid in new_params:
            params, expected = new_params[sid], 0
        else:
            state = seqs[sid]
            params, expected = state.params, state.num_computed
        if params.prompt_logprobs is not None and row.start != expected:
            raise PlanError(f"seq {sid}: prompt_logprobs need every position; its chunk starts at "
                            f"{row.start}, after {expected} computed")


def apply_plan_diffs(plan: engine_pb2.StepPlan, seqs: dict[int, SequenceState],
                     new_states: Mapping[int, SequenceState] | None = None,
                     rows: list[ChunkRow] | None = None) -> None:
    """Free, add, and extend block tables, in the plan's order (plan checked).
    ``new_states``: ``validate_plan``'s states of the new sequences (else made again);
    ``rows``: the plan's ``chunk_rows``, if the caller has them."""
    for sid in plan.freed_seq_ids:
        del seqs[sid]
    for new in plan.new_sequences:
        seqs[new.seq_id] = new_states[new.seq_id] if new_states is not None else sequence_state(new)
    for row in rows if rows is not None else chunk_rows(plan):
        state = seqs[row.seq_id]
        if row.num_blocks:
            state.block_table.extend(plan.chunks[row.plan_index].new_block_ids)
        state.num_computed = row.start + row.num_ids + row.from_sample
