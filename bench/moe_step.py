"""The reduced Qwen3-30B-A3B MoE shape's batch-1 decode step, in process, against its floor.

    .venv/bin/python bench/moe_step.py [--rounds 3] [--steps 10] [--model DIR]

The model is ``bench/families.py``'s ``qwen3-moe-4l`` (random bf16 weights, 4 of the
48 layers, real hidden and expert sizes), made once into ``--model`` (default a
folder under /tmp) and loaded by a ``ModelRunner`` (the CPU's batch-invariant
kernels, as `jitney serve` runs them). One sequence of 30 prompt tokens is
prefilled, then each round times ``--steps`` decode steps of it (plan to sampled
token) and, right after, the read rate (``families.read_rate_gb_s``). The floor is
``families.moe_routed_bytes`` (attention, router and 8 experts a layer, and the
head) over that rate.

Then the step's parts, each timed after a read that flushes the caches: one
layer's experts at one token (8 routed) and the head (151936 x 2048) at one row,
each against a sum of the same bytes. Printed: the step's median, floor and
ratio per round; each part's time, its bytes' sum time and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.families import QWEN3_MOE, make_model, moe_routed_bytes, read_rate_gb_s  # noqa: E402


def flush_then(f: object, flush: torch.Tensor) -> float:
    flush.sum()
    started = time.perf_counter()
    f()  # type: ignore[operator]
    return time.perf_counter() - started


def sum_seconds(nbytes: int, flush: torch.Tensor) -> float:
    """The best of 5 sums of a float32 tensor of ``nbytes``, each after a flush."""
    same = torch.ones(nbytes // 4)
    return min(flush_then(same.sum, flush) for _ in range(5))


def parts(runner: object) -> list[tuple[str, float, float]]:
    """(part, median seconds, sum seconds of its bytes) for one layer's experts and the head."""
    from jitney.worker.layers.moe import FusedExperts

    model = runner.model  # type: ignore[attr-defined]
    experts = next(m for m in model.modules() if isinstance(m, FusedExperts))
    h, inter, e = QWEN3_MOE["hidden_size"], QWEN3_MOE["moe_intermediate_size"], QWEN3_MOE["num_experts"]
    flush = torch.ones(512 * 1024 * 1024 // 4)
    x = torch.randn(1, h, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    weights = torch.full((1, 8), 0.125)

    def routed() -> None:
        ids = torch.randperm(e, generator=gen)[:8].view(1, 8)
        experts.forward(x, ids, weights)

    expert_s = statistics.median(flush_then(routed, flush) for _ in range(15))
    head_s = statistics.median(flush_then(lambda: model.lm_head(x), flush) for _ in range(7))
    expert_bytes = 8 * 3 * h * inter * 2
    head_bytes = QWEN3_MOE["vocab_size"] * h * 2
    return [("experts, 1 layer, 1 token", expert_s, sum_seconds(expert_bytes, flush)),
            ("head, 1 row", head_s, sum_seconds(head_bytes, flush))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", type=Path, default=Path("/tmp/jitney-bench-qwen3-moe-4l"))
    ns = parser.parse_args()
    from jitney.worker.config import WorkerConfig
    from jitney.worker.runner.model_runner import ModelRunner
    from tests.support.runner_driver import BLOCK, NUM_BLOCKS, Driver

    if not (ns.model / "config.json").exists():
        make_model("qwen3-moe-4l", ns.model)
    runner = ModelRunner(WorkerConfig(model=str(ns.model), dtype="bfloat16", block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                      max_num_batched_tokens=256, max_num_seqs=8, use_weights_cache=False))
    driver = Driver(runner)
    driver.add(1, list(range(10, 40)))
    driver.step({1: 30})
    print(f"torch threads {torch.get_num_threads()}; floor bytes {moe_routed_bytes() / 1e9:.3f} GB")
    print("| round | decode step ms (median) | read rate GB/s | floor ms | step / floor |")
    print("|---|---|---|---|---|")
    for i in range(ns.rounds):
        times = []
        for _ in range(ns.steps):
            started = time.perf_counter()
            driver.step({1: 1})
            times.append(time.perf_counter() - started)
        rate = read_rate_gb_s()
        floor = moe_routed_bytes() / (rate * 1e9)
        step = statistics.median(times)
        print(f"| {i + 1} | {step * 1e3:.1f} | {rate:.1f} | {floor * 1e3:.1f} | {step / floor:.2f} |", flush=True)
    print("| part | ms (median) | sum of its bytes ms | ratio |")
    print("|---|---|---|---|")
    for name, seconds, floor_s in parts(runner):
        print(f"| {name} | {seconds * 1e3:.2f} | {floor_s * 1e3:.2f} | {seconds / floor_s:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
