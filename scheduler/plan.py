"""Encode a SchedulerOutput as the worker's StepPlan (a diff).

    plan field        carries
    freed_seq_ids     sequences the worker forgets first (finished, preempted)
    new_sequences     sampling config of sequences the worker has no state for
    chunks            tokens to compute + block ids appended to the table this
                      step (a resumed sequence re-sends its whole new table)
"""

from __future__ import annotations

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.request import Request
from jitney.scheduler.scheduler import ScheduledChunk, SchedulerOutput

_UINT64_MASK = (1 << 64) - 1


def to_step_plan(output: SchedulerOutput) -> engine_pb2.StepPlan:
    """The StepPlan message for one scheduled step."""
    return engine_pb2.StepPlan(
        step_id=output.step_id,
        freed_seq_ids=output.freed_seq_ids,
        new_sequences=[_new_sequence(r) for r in output.new_seqs],
        chunks=[_chunk(c) for c in output.scheduled],
    )


def _new_sequence(request: Request) -> engine_pb2.NewSequence:
    sampling = request.sampling
    return engine_pb2.NewSequence(
        seq_id=request.seq_id,
        sampling=engine_pb2.SamplingConfig(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed & _UINT64_MASK,   # wire type is uint64
        ),
    )


def _chunk(chunk: ScheduledChunk) -> engine_pb2.ScheduledChunk:
    return engine_pb2.ScheduledChunk(
        seq_id=chunk.request.seq_id,
        start_position=chunk.start_position,
        token_ids=chunk.token_ids,
        new_block_ids=chunk.new_block_ids,
        sample=chunk.sample,
        last_token_from_sample=chunk.last_token_from_sample,
    )
