"""A worker ``ModelRunner`` driven with engine plans: its sizes, the plans, one decode or prefill step timed."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from bench.gpu_sections.plumbing import Run, dtype_name

if TYPE_CHECKING:
    from jitney.engine.v1 import engine_pb2
    from jitney.worker.runner.model_runner import ModelRunner


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def make_runner(model: Path, run: Run, max_seqs: int | None, num_blocks: int, *,
                batch_invariant: bool | None = None) -> ModelRunner:
    """``max_seqs`` None: the device's default seats (256 on CUDA); ``batch_invariant`` None: its default."""
    from jitney.worker.config import Device, DType, WorkerConfig
    from jitney.worker.runner.model_runner import ModelRunner

    config = WorkerConfig(model=str(model), device=cast(Device, run.args.device),
                          dtype=cast(DType, dtype_name(run.args)), num_blocks=num_blocks, max_num_seqs=max_seqs,
                          max_num_batched_tokens=step_tokens(run), batch_invariant=batch_invariant)
    return ModelRunner(config)


def step_tokens(run: Run) -> int:
    """The runner's step budget: 2048 (or the prefill step, if larger), set explicitly."""
    return max(2048, *run.args.prefill_tokens)


def runner_blocks(run: Run, batches: list[int], block_size: int = 16) -> tuple[int, int]:
    """(blocks per decode sequence, total blocks) the decode and prefill measurements need."""
    per_seq = blocks_for(run.args.context + run.args.reps + 8, block_size)
    total = max(max(batches, default=1) * per_seq, blocks_for(max(run.args.prefill_tokens), block_size)) + 16
    return per_seq, total


def prefill_plans(batch: int, context: int, per_seq: int, budget_tokens: int) -> Iterator[engine_pb2.StepPlan]:
    """Plans that add and prefill sequences 1..batch with ``context`` tokens, within the step budget."""
    from jitney.engine.v1 import engine_pb2 as e

    group = max(1, budget_tokens // context)
    for first in range(0, batch, group):
        plan = e.StepPlan(step_id=1)
        for i in range(first, min(batch, first + group)):
            plan.new_sequences.add(seq_id=i + 1, sampling=e.SamplingConfig(seed=1))
            ids = [100 + (7 * i + j) % 40000 for j in range(context)]
            plan.chunks.add(seq_id=i + 1, start_position=0, token_ids=ids,
                            new_block_ids=list(range(i * per_seq, (i + 1) * per_seq)), sample=True)
        yield plan


def prompt_plan(step_id: int, seq_id: int, ids: list[int], blocks: list[int]) -> engine_pb2.StepPlan:
    """A new sequence's whole prompt as one chunk that samples."""
    from jitney.engine.v1 import engine_pb2 as e

    plan = e.StepPlan(step_id=step_id)
    plan.new_sequences.add(seq_id=seq_id, sampling=e.SamplingConfig(seed=1))
    plan.chunks.add(seq_id=seq_id, start_position=0, token_ids=ids, new_block_ids=blocks, sample=True)
    return plan


def decodes_ready(runner: ModelRunner, batch: int, run: Run, per_seq: int) -> None:
    """Sequences 1..batch prefilled with --context tokens, then three warm-up decode steps."""
    for plan in prefill_plans(batch, run.args.context, per_seq, step_tokens(run)):
        runner.execute(plan)
    for k in range(3):
        runner.execute(decode_plan(batch, run.args.context + k))


def decode_plan(batch: int, position: int) -> engine_pb2.StepPlan:
    from jitney.engine.v1 import engine_pb2 as e

    plan = e.StepPlan(step_id=2 + position)
    for i in range(batch):
        plan.chunks.add(seq_id=i + 1, start_position=position, token_ids=[5], sample=True)
    return plan


def timed_execute(runner: ModelRunner, plan: engine_pb2.StepPlan, expected: int) -> float:
    started = time.perf_counter()
    result = runner.execute(plan)
    elapsed = time.perf_counter() - started
    if len(result.token_ids) != expected:
        raise RuntimeError(f"step {plan.step_id}: {len(result.token_ids)} tokens, expected {expected}")
    return elapsed


def graph_replay_s(runner: ModelRunner, batch: int) -> tuple[float | None, str]:
    """The captured decode graph alone (``replay_seconds``: CUDA events), or None and why not."""
    if runner.graphs is None:
        return None, "no captured graphs (CPU or eager backend)"
    try:
        return runner.graphs.replay_seconds(batch), ""
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the rest still measures
        return None, f"replay_seconds({batch}) failed: {type(exc).__name__}: {exc}"


def measure_decode(runner: ModelRunner, batch: int, run: Run, per_seq: int) -> dict[str, Any]:
    """Wall time of ``execute()`` of decode steps of ``batch`` sequences, and the graph alone."""
    from jitney.engine.v1 import engine_pb2 as e

    context, warmup = run.args.context, 3
    for plan in prefill_plans(batch, context, per_seq, step_tokens(run)):
        runner.execute(plan)
    times = [timed_execute(runner, decode_plan(batch, context + k), batch) for k in range(warmup + run.args.reps)]
    graph_s, graph_note = graph_replay_s(runner, batch)
    runner.execute(e.StepPlan(step_id=10_000, freed_seq_ids=list(range(1, batch + 1))))
    kept = times[warmup:]
    return {"batch": batch, "context": context, "reps": len(kept), "execute_s_median": statistics.median(kept),
            "execute_s_min": min(kept), "graph_s": graph_s, "graph_note": graph_note}


def measure_prefill(runner: ModelRunner, run: Run, tokens: int) -> dict[str, Any]:
    """Wall time of ``execute()`` of one step of a single chunk of ``tokens``; fresh sequence each time."""
    from jitney.engine.v1 import engine_pb2 as e

    ids = [100 + (13 * j) % 40000 for j in range(tokens)]
    blocks = list(range(blocks_for(tokens, runner.config.block_size)))
    times = []
    for rep in range(2 + run.args.reps):   # a cold one, a warm-up, then the reps
        seq = 50_000 + rep
        times.append(timed_execute(runner, prompt_plan(20_000 + rep, seq, ids, blocks), 1))
        runner.execute(e.StepPlan(step_id=30_000 + rep, freed_seq_ids=[seq]))
    kept = times[2:]
    return {"tokens": tokens, "reps": len(kept), "first_s": times[0], "execute_s_median": statistics.median(kept),
            "execute_s_min": min(kept)}


def decode_batches(args: argparse.Namespace) -> list[int]:
    """--batch, capped by --limit where one is given (CPU plumbing: batches 1 and 2)."""
    batches = sorted(set(args.batch))
    if args.limit:
        batches = sorted({min(b, max(1, args.limit // 2)) for b in batches})
    return batches
