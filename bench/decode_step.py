#!/usr/bin/env python3
"""Model time of one decode step of the default model, by batch size and dtype.

    .venv/bin/python bench/decode_step.py [--dtype float32 bfloat16] [--batch 1 8 16 32 64] [--context 100]

Drives the worker's ModelRunner directly with engine plans: each of B
sequences is prefilled with ``--context`` tokens, then decode steps are
timed (the best of 5, ``model_seconds`` as the worker reports it: forward +
logits; ``worker`` adds input preparation and sampling).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client._generated.jitney.engine.v1 import engine_pb2 as e  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402


def measure(runner: ModelRunner, batch: int, context: int, reps: int = 5) -> tuple[float, float]:
    blocks = -(-(context + reps + 8) // 16)
    plan = e.StepPlan(step_id=1)
    for i in range(batch):
        plan.new_sequences.add(seq_id=i + 1, sampling=e.SamplingConfig(seed=1))
        plan.chunks.add(seq_id=i + 1, start_position=0, token_ids=[100 + j for j in range(context)],
                        new_block_ids=list(range(i * blocks, (i + 1) * blocks)), sample=True)
    runner.execute(plan)
    best = (float("inf"), float("inf"))
    for k in range(reps + 2):
        step = e.StepPlan(step_id=2 + k)
        for i in range(batch):
            step.chunks.add(seq_id=i + 1, start_position=context + k, token_ids=[5], sample=True)
        result = runner.execute(step)
        if k >= 2:   # warm-up
            best = min(best, (result.model_seconds, result.forward_seconds))
    runner.execute(e.StepPlan(step_id=100, freed_seq_ids=list(range(1, batch + 1))))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=100)
    args = parser.parse_args()
    print("| dtype | batch | model ms | worker ms |\n|---|---|---|---|")
    for dtype in args.dtype:
        runner = ModelRunner(WorkerConfig(dtype=dtype, num_blocks=4096, max_num_batched_tokens=16384,
                                          max_num_seqs=256))
        for batch in args.batch:
            model_s, worker_s = measure(runner, batch, args.context)
            print(f"| {dtype} | {batch} | {model_s * 1000:.1f} | {worker_s * 1000:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
