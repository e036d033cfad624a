"""Per-sequence worker state and the strict checking of step plans.

A plan is checked as a whole against the state *before* anything is
applied, so a rejected plan leaves the worker exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

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


@dataclass
class SequenceState:
    """What the worker remembers about one sequence between steps."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    block_table: list[int] = field(default_factory=list)
    last_sampled: int | None = None   # the token sampled in this sequence's latest step


def chunk_tokens(chunk: engine_pb2.ScheduledChunk, state: SequenceState) -> list[int]:
    """The token ids a chunk computes, its sampled placeholder filled in."""
    tokens = list(chunk.token_ids)
    if chunk.last_token_from_sample:
        assert state.last_sampled is not None  # checked by validate_plan
        tokens.append(state.last_sampled)
    return tokens


def sequence_state(seq: engine_pb2.NewSequence) -> SequenceState:
    """Fresh state for a new sequence, its sampling parameters checked."""
    s = seq.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise PlanError(f"seq {seq.seq_id}: temperature must be finite and >= 0, got {s.temperature}")
    # proto3 cannot tell an unset top_p from 0: read 0 as "off" (1.0).
    top_p = 1.0 if s.top_p == 0 else s.top_p
    if not (0 < top_p <= 1):
        raise PlanError(f"seq {seq.seq_id}: top_p must be in (0, 1], got {s.top_p}")
    return SequenceState(temperature=s.temperature, top_p=top_p, top_k=s.top_k, seed=s.seed)


def validate_plan(plan: engine_pb2.StepPlan, seqs: Mapping[int, SequenceState], limits: PlanLimits) -> None:
    """Raise ``PlanError`` if ``plan`` cannot be applied to ``seqs``."""
    prefix = f"step {plan.step_id}: "
    try:
        table_lens = _check_diffs(plan, seqs)
        if len(table_lens) > limits.max_num_seqs:
            raise PlanError(f"{len(table_lens)} live sequences exceed max_num_seqs {limits.max_num_seqs}")
        _check_chunks(plan, table_lens, limits, seqs)
    except PlanError as err:
        raise PlanError(prefix + str(err)) from None


def _check_diffs(plan: engine_pb2.StepPlan, seqs: Mapping[int, SequenceState]) -> dict[int, int]:
    """Check freed and new sequences; return the block-table length of each live one."""
    freed = list(plan.freed_seq_ids)
    if len(set(freed)) != len(freed):
        raise PlanError("a seq_id is freed twice")
    unknown = [s for s in freed if s not in seqs]
    if unknown:
        raise PlanError(f"freed unknown seq_id {unknown[0]}")
    gone = set(freed)
    table_lens = {sid: len(state.block_table) for sid, state in seqs.items() if sid not in gone}
    for new in plan.new_sequences:
        if new.seq_id in table_lens:
            raise PlanError(f"new sequence {new.seq_id} is already known")
        sequence_state(new)  # raises on bad sampling parameters
        table_lens[new.seq_id] = 0
    return table_lens


def _check_chunks(plan: engine_pb2.StepPlan, table_lens: dict[int, int], limits: PlanLimits,
                  seqs: Mapping[int, SequenceState]) -> None:
    if len(plan.chunks) > limits.max_num_seqs:
        raise PlanError(f"{len(plan.chunks)} chunks exceed max_num_seqs {limits.max_num_seqs}")
    new_ids = {n.seq_id for n in plan.new_sequences}
    for chunk in plan.chunks:
        if chunk.last_token_from_sample and (
                chunk.seq_id in new_ids or chunk.seq_id not in seqs
                or seqs[chunk.seq_id].last_sampled is None):
            raise PlanError(f"seq {chunk.seq_id}: last_token_from_sample but nothing was sampled for it")
    total = sum(len(c.token_ids) + c.last_token_from_sample for c in plan.chunks)
    if total > limits.max_num_batched_tokens:
        raise PlanError(f"{total} tokens exceed max_num_batched_tokens {limits.max_num_batched_tokens}")
    seen: set[int] = set()
    for chunk in plan.chunks:
        if chunk.seq_id not in table_lens:
            raise PlanError(f"chunk for unknown seq_id {chunk.seq_id}")
        if chunk.seq_id in seen:
            raise PlanError(f"seq {chunk.seq_id} has two chunks in one step")
        seen.add(chunk.seq_id)
        _check_chunk(chunk, table_lens[chunk.seq_id], limits)


def _check_chunk(chunk: engine_pb2.ScheduledChunk, table_len: int, limits: PlanLimits) -> None:
    sid = chunk.seq_id
    num_tokens = len(chunk.token_ids) + chunk.last_token_from_sample
    if not num_tokens:
        raise PlanError(f"seq {sid}: chunk has no token_ids")
    if chunk.token_ids and max(chunk.token_ids) >= limits.vocab_size:
        raise PlanError(f"seq {sid}: token id {max(chunk.token_ids)} outside vocab of {limits.vocab_size}")
    bad = [b for b in chunk.new_block_ids if b >= limits.num_blocks]
    if bad:
        raise PlanError(f"seq {sid}: block id {bad[0]} out of range (num_blocks {limits.num_blocks})")
    end = chunk.start_position + num_tokens
    if end > limits.context_length:
        raise PlanError(f"seq {sid}: positions up to {end} exceed context length {limits.context_length}")
    capacity = (table_len + len(chunk.new_block_ids)) * limits.block_size
    if end > capacity:
        raise PlanError(f"seq {sid}: positions up to {end} exceed its block table capacity {capacity}")


def apply_plan_diffs(plan: engine_pb2.StepPlan, seqs: dict[int, SequenceState]) -> None:
    """Free, add, and extend block tables, in the plan's order (plan checked)."""
    for sid in plan.freed_seq_ids:
        del seqs[sid]
    for new in plan.new_sequences:
        seqs[new.seq_id] = sequence_state(new)
    for chunk in plan.chunks:
        seqs[chunk.seq_id].block_table.extend(chunk.new_block_ids)
