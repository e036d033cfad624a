"""Time of one decoder layer's base linears (qkv, o, gate_up, down on ``InvariantLinear``,
the CPU's batch-invariant path) against the rank-16 LoRA deltas of its seven modules
(q, k, v, o, gate, up, down) for rows spread over 4 adapters, at 1/32/256 rows, bf16:
the C++ kernel (``jitney_cpu.lora_add``, csrc/lora.cpp) and the torch path
(``layers/lora.py``'s ``lora_delta``); "fixed" is the seven C++ calls with every row a base
row (the dispatcher from Python, the checks, the sort: what the layer stack's calls pay less of).
A rough figure: run it on a quiet machine for a real one.

    python bench/lora_kernel.py [--shape smollm2|llama8b] [--threads N] [--no-torch]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.layers.lora import lora_delta

# hidden, q, kv, intermediate
SHAPES = {"smollm2": (576, 576, 192, 1536), "llama8b": (4096, 4096, 1024, 14336)}
RANK, ADAPTERS = 16, 4


def _time(fn: Callable[[], None], seconds: float = 0.5) -> float:
    """Mean ms of ``fn`` over at least 3 calls and about ``seconds`` (after one warm-up call)."""
    fn()
    start, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-torch", action="store_true", help="skip the torch path (slow at many rows)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = torch.bfloat16
    hidden, q, kv, inter = SHAPES[args.shape]
    # (in, out) of the layer's linears; each module: (its linear, in, out, offset in the linear's output)
    linears = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]
    modules = [(0, hidden, q, 0), (0, hidden, kv, q), (0, hidden, kv, q + kv), (1, q, hidden, 0),
               (2, hidden, inter, 0), (2, hidden, inter, inter), (3, inter, hidden, 0)]
    layers = [cpu_kernels.InvariantLinear(torch.randn(out, inp, dtype=dt) * 0.02, None) for inp, out in linears]
    slots = []
    for _, inp, out, _ in modules:
        a, b = torch.randn(ADAPTERS + 1, RANK, inp, dtype=dt) * 0.02, torch.randn(ADAPTERS + 1, out, RANK, dtype=dt)
        a[0], b[0] = 0, 0
        slots.append((a, b, torch.ones(ADAPTERS + 1)))
    print(f"{args.shape}, rank {RANK}, {ADAPTERS} adapters, {torch.get_num_threads()} threads, "
          f"lora_add on {cpu_kernels.lora_kernel()}")
    for rows in (1, 32, 256):
        xs = [torch.randn(rows, inp, dtype=dt) for inp, _ in linears]
        ys = [layer(x) for layer, x in zip(layers, xs)]
        index = (torch.arange(rows, dtype=torch.int32) % ADAPTERS) + 1
        base_rows = torch.zeros(rows, dtype=torch.int32)

        def base() -> None:
            for layer, x in zip(layers, xs):
                layer(x)

        def kernel() -> None:
            for (linear, _, _, offset), (a, b, s) in zip(modules, slots):
                cpu_kernels.lora_add(ys[linear], xs[linear], a, b, s, index, offset)

        def fixed() -> None:
            for (linear, _, _, offset), (a, b, s) in zip(modules, slots):
                cpu_kernels.lora_add(ys[linear], xs[linear], a, b, s, base_rows, offset)

        def torch_path() -> None:
            for (linear, _, out, offset), (a, b, s) in zip(modules, slots):
                part = ys[linear][:, offset: offset + out]
                part.copy_((part.float() + lora_delta(xs[linear], a, b, s, index)).to(dt))

        t_base, t_kernel, t_fixed = _time(base), _time(kernel), _time(fixed)
        line = (f"rows {rows:4d}: base linears {t_base:8.3f} ms, C++ deltas {t_kernel:8.3f} ms "
                f"({t_kernel / t_base:.3f}x; fixed {t_fixed:.3f} ms)")
        if not args.no_torch:
            t_torch = _time(torch_path)
            line += f", torch deltas {t_torch:8.3f} ms ({t_torch / t_base:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
