"""Encode a SchedulerOutput as the worker's StepPlan (a diff).

    plan field        carries
    reset             after a failed step: the worker forgets every sequence first
    freed_seq_ids     sequences the worker forgets first (finished, preempted)
    lora_loads        adapters put into slots (after the frees, before the new
                      sequences, which may use them: lora.py)
    new_sequences     sampling config of sequences the worker has no state for,
                      with their adapter slot (lora_slot; 0 = the base model)
    chunks            tokens to compute + block ids appended to the table this
                      step (a resumed sequence re-sends its whole new table)
"""

from __future__ import annotations

from collections.abc import Callable

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.request import Request, SamplingOptions
from jitney.scheduler.core.scheduler import ScheduledChunk, SchedulerOutput

_UINT64_MASK = (1 << 64) - 1


def to_step_plan(output: SchedulerOutput, eos_token_ids: frozenset[int] = frozenset(),
                 masked: Callable[[Request], bool] | None = None, draft_model: bool = False) -> engine_pb2.StepPlan:
    """The StepPlan message for one scheduled step.

    ``eos_token_ids``: the model's, banned (with the stop ids) while a
    request is short of its ``min_tokens``. ``masked``: whether a sampling
    chunk's request is constrained (its bitmask follows in a StepMasks).
    ``draft_model``: the worker runs one (a new sequence's cached prefix goes
    with it: ``draft_context_token_ids``).
    """
    starts = {c.request.seq_id: c.start_position for c in output.scheduled}
    return engine_pb2.StepPlan(
        step_id=output.step_id,
        freed_seq_ids=output.freed_seq_ids,
        new_sequences=[_new_sequence(r, eos_token_ids, starts.get(r.seq_id, 0), draft_model)
                       for r in output.new_seqs],
        chunks=[_chunk(c, masked) for c in output.scheduled],
        reset=output.reset,
        lora_loads=[engine_pb2.LoraLoad(slot=o.slot, name=o.name, path=o.path) for o in output.lora_loads],
    )


def _new_sequence(request: Request, eos_token_ids: frozenset[int], start: int,
                  draft_model: bool = False) -> engine_pb2.NewSequence:
    """A sequence the worker has no state for; ``start``: its first chunk's position."""
    s = request.sampling
    config = engine_pb2.SamplingConfig(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed & _UINT64_MASK,   # wire type is uint64
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias_ids=[t for t, _ in s.logit_bias],
        logit_bias_values=[b for _, b in s.logit_bias],
        min_tokens=s.min_tokens,
        top_logprobs=s.top_logprobs,
        num_prompt_tokens=request.num_prompt_tokens,
    )
    if s.min_tokens:
        config.min_tokens_banned_ids.extend(sorted(min_tokens_banned(s, eos_token_ids)))
    if request.wants_prompt_logprobs:
        config.prompt_logprobs = s.prompt_logprobs or 0
    new = engine_pb2.NewSequence(seq_id=request.seq_id, sampling=config, lora_slot=request.lora_slot)
    if start and request.penalised:    # a cached or shared prefix the worker will not compute
        new.context_token_ids.extend(request.all_token_ids[:start])
    if start and draft_model and request.may_draft:
        new.draft_context_token_ids.extend(request.all_token_ids[:start])
    return new


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed``: the seed
    itself for sample 0 (so n = 1 and the first of n agree), else a
    splitmix64 mix of (seed, index): independent streams, reproducible."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _UINT64_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return z ^ (z >> 31)


def min_tokens_banned(sampling: SamplingOptions, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """Token ids that cannot be sampled before ``min_tokens``: the stop ids,
    and the end-of-sequence ids unless ``ignore_eos``."""
    return sampling.stop_token_ids | (frozenset() if sampling.ignore_eos else eos_token_ids)


def _chunk(chunk: ScheduledChunk, masked: Callable[[Request], bool] | None) -> engine_pb2.ScheduledChunk:
    return engine_pb2.ScheduledChunk(
        seq_id=chunk.request.seq_id,
        start_position=chunk.start_position,
        token_ids=chunk.token_ids,
        new_block_ids=chunk.new_block_ids,
        sample=chunk.sample,
        last_token_from_sample=chunk.last_token_from_sample,
        masked=chunk.sample and masked is not None and masked(chunk.request),
        num_draft_tokens=chunk.num_draft_tokens,
        num_proposals=chunk.num_proposals,
    )
