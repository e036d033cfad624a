"""Time of one Llama-8B-shaped layer's linears (qkv, o, gate_up, down) with and without a
4-adapter rank-16 mix (``layers/lora.py``'s torch delta), at 1/32/256 rows, bf16 on the CPU.
A rough figure: run it on a quiet machine for a real one.

    python bench/lora_kernel.py [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from jitney.worker.layers.lora import lora_delta

HIDDEN, Q, KV, INTER, RANK, ADAPTERS = 4096, 4096, 1024, 14336, 16, 4


def _time(fn: object, repeats: int = 5) -> float:
    assert callable(fn)
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = torch.bfloat16
    shapes = [(HIDDEN, Q + 2 * KV), (Q, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]
    weights = [torch.randn(out, inp, dtype=dt) * 0.02 for inp, out in shapes]
    slots = [(torch.randn(ADAPTERS + 1, RANK, inp, dtype=dt), torch.randn(ADAPTERS + 1, out, RANK, dtype=dt),
              torch.ones(ADAPTERS + 1)) for inp, out in shapes]
    for rows in (1, 32, 256):
        xs = [torch.randn(rows, inp, dtype=dt) for inp, _ in shapes]
        index = (torch.arange(rows, dtype=torch.int32) % ADAPTERS) + 1

        def base() -> None:
            for x, w in zip(xs, weights):
                F.linear(x, w)

        def mixed() -> None:
            for x, w, (a, b, s) in zip(xs, weights, slots):
                y = F.linear(x, w)
                y += lora_delta(x, a, b, s, index).to(dt)

        t_base, t_mix = _time(base), _time(mixed)
        print(f"rows {rows:4d}: base {t_base:8.2f} ms, 4-adapter mix {t_mix:8.2f} ms ({t_mix / t_base:.2f}x)")


if __name__ == "__main__":
    main()
