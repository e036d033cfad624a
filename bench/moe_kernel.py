"""The CPU's MoE experts op (``csrc/moe.cpp``) at a Qwen3-30B-A3B layer, against its weights' floor.

    .venv/bin/python bench/moe_kernel.py [--tokens 1 16 64] [--reps 15]

One layer's experts (hidden 2048, intermediate 768, 128 experts, top-8: random bf16
weights, 1.2 GB) run by ``InvariantMoeExperts``. Each timed call routes its tokens
to fresh random experts (8 distinct a token, uniformly) and follows an untimed
read of ``--flush-mb`` (past the last-level cache), so the routed experts' weights
come from memory, as in a model's step, where the other layers' weights pass
through the caches in between.

The floor of a call is the bytes of the weights of the distinct experts it routes
to (gate, up and down: 3 H I bf16 values each) over the memory's read rate,
measured here as ``bench/cpu_floor.py`` measures it (the best of sums of a float32
tensor of ``--bandwidth-mb`` on torch's threads), before the calls and after them,
the faster of the two. Printed per token count: the median time, the median
floor, the median ratio of time to floor, and the rate the weights were read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.cpu_floor_measure import measure_bandwidth  # noqa: E402
from jitney.worker.kernels.cpu import ops as cpu_kernels  # noqa: E402
from jitney.worker.kernels.cpu.moe import InvariantMoeExperts  # noqa: E402


def build_layer(experts: int, hidden: int, inter: int, gen: torch.Generator) -> tuple[InvariantMoeExperts, float]:
    """Random experts, and the seconds their packing took."""
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, generator=gen, dtype=torch.bfloat16) * 0.02
    started = time.perf_counter()
    moe = InvariantMoeExperts(gate_up, down)
    return moe, time.perf_counter() - started


def time_tokens(moe: InvariantMoeExperts, tokens: int, k: int, reps: int, flush: torch.Tensor,
                gen: torch.Generator) -> tuple[list[float], list[int]]:
    """Seconds of each call after a warm-up, and the distinct experts each call routed to."""
    seconds, distinct = [], []
    for rep in range(reps + 1):
        x = torch.randn(tokens, moe.hidden_size, generator=gen).bfloat16()
        ids = torch.rand(tokens, moe.num_experts, generator=gen).argsort(dim=1)[:, :k]
        weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
        flush.sum()
        started = time.perf_counter()
        moe(x, ids, weights)
        elapsed = time.perf_counter() - started
        if rep:
            seconds.append(elapsed)
            distinct.append(int(ids.unique().numel()))
    return seconds, distinct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--flush-mb", type=int, default=1024, help="read between calls (past the LLC)")
    parser.add_argument("--bandwidth-mb", type=int, default=2048)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    # The read rate before and after the calls (the machine may be shared), the best of
    # both: the floor is a lower bound.
    rate_before = measure_bandwidth(args.bandwidth_mb, 5)
    moe, packing = build_layer(args.experts, args.hidden, args.intermediate, gen)
    expert_bytes = 3 * args.hidden * args.intermediate * 2
    flush = torch.ones(args.flush_mb * 2**20 // 4)
    timed = {tokens: time_tokens(moe, tokens, args.top_k, args.reps, flush, gen) for tokens in args.tokens}
    del flush
    bandwidth = max(rate_before, measure_bandwidth(args.bandwidth_mb, 5)) * 1e9   # bytes / s
    print(f"torch threads {torch.get_num_threads()}, bf16 kernel {cpu_kernels.linear_kernel()}, "
          f"read rate {bandwidth / 1e9:.1f} GB/s (sum of {args.bandwidth_mb} MB), layer H {args.hidden} "
          f"I {args.intermediate} E {args.experts} k {args.top_k}: {args.experts * expert_bytes / 1e9:.2f} GB, "
          f"packed in {packing:.1f} s")
    print("| tokens | experts routed (median) | weights read (MB) | ms (median) | floor ms | ms / floor "
          "| weights GB/s |")
    print("|---|---|---|---|---|---|---|")
    for tokens, (seconds, distinct) in timed.items():
        floors = [d * expert_bytes / bandwidth for d in distinct]
        ratio = statistics.median(s / f for s, f in zip(seconds, floors))
        routed = statistics.median(distinct)
        rate = statistics.median(d * expert_bytes / s for d, s in zip(distinct, seconds))
        print(f"| {tokens} | {routed:g} | {routed * expert_bytes / 1e6:.1f} | {statistics.median(seconds) * 1e3:.2f} "
              f"| {statistics.median(floors) * 1e3:.2f} | {ratio:.2f} | {rate / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
