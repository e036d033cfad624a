#!/usr/bin/env python3
"""The worker's decode step on the CPU, by batch size: model time and the rest.

    .venv/bin/python bench/decode_step.py [--dtype float32 bfloat16] [--batch 1 8 16 32 64] [--context 100]
        [--invariant on off]

Drives the worker's ModelRunner directly with engine plans: each of B
sequences is prefilled with ``--context`` tokens, then ``--reps`` decode
steps are timed. Per step: ``execute`` = wall time of ``runner.execute``
(plan checks, diffs, input staging, forward, logits, sampling, results);
``model`` = forward + logits as the worker reports it (``model_seconds``);
``non-model`` = their difference, the worker's own overhead. Medians.
``--invariant on off`` measures the batch-invariant kernels (the CPU
default) and ``--no-batch-invariant``'s oneDNN path side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.engine.v1 import engine_pb2 as e  # noqa: E402
from jitney.worker.config import WorkerConfig  # noqa: E402
from jitney.worker.runner import ModelRunner  # noqa: E402


def measure(runner: ModelRunner, batch: int, context: int, reps: int) -> tuple[float, float]:
    """Median (model seconds, execute seconds) of ``reps`` decode steps of ``batch`` sequences."""
    blocks = -(-(context + reps + 8) // 16)
    plan = e.StepPlan(step_id=1)
    for i in range(batch):
        plan.new_sequences.add(seq_id=i + 1, sampling=e.SamplingConfig(seed=1))
        plan.chunks.add(seq_id=i + 1, start_position=0, token_ids=[100 + j for j in range(context)],
                        new_block_ids=list(range(i * blocks, (i + 1) * blocks)), sample=True)
    runner.execute(plan)
    model, total = [], []
    for k in range(reps + 2):
        step = e.StepPlan(step_id=2 + k)
        for i in range(batch):
            step.chunks.add(seq_id=i + 1, start_position=context + k, last_token_from_sample=True, sample=True)
        started = time.perf_counter()
        result = runner.execute(step)
        if k >= 2:   # warm-up
            total.append(time.perf_counter() - started)
            model.append(result.model_seconds)
    runner.execute(e.StepPlan(step_id=100, freed_seq_ids=list(range(1, batch + 1))))
    return statistics.median(model), statistics.median(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--invariant", nargs="+", choices=["on", "off"], default=["on"],
                        help="batch-invariant kernels (on, the CPU default) and/or --no-batch-invariant (off)")
    args = parser.parse_args()
    print("| dtype | invariant | batch | model ms | execute ms | non-model ms |\n|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for invariant in args.invariant:
            runner = ModelRunner(WorkerConfig(dtype=dtype, num_blocks=4096, max_num_batched_tokens=16384,
                                              max_num_seqs=256, batch_invariant=invariant == "on"))
            for batch in args.batch:
                model_s, total_s = measure(runner, batch, args.context, args.reps)
                print(f"| {dtype} | {invariant} | {batch} | {model_s * 1000:.1f} | {total_s * 1000:.1f} | "
                      f"{(total_s - model_s) * 1000:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
