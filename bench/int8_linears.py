"""The CPU's linear kernels against each other, per shape of the default model.

    .venv/bin/python bench/int8_linears.py [--rows 1 64 512] [--reps 7]

For each linear shape of SmolLM2-135M (30 distinct random weights per layer
shape, one for the head), every weight is called once per pass, so each pass
streams all of them from memory as a step does. Four kernels take turns:

- ``bf16``: ``InvariantLinear``, the CPU default (Jitney's AMX-BF16 tile
  kernel where the CPU has it, else its AVX-512 BF16 one: ``linear_kernel()``);
- ``torch``: ``torch.nn.functional.linear`` in bf16, oneDNN's matmul (not
  batch-invariant: the speed Jitney's kernels are held to);
- ``int8``: ``Int8Linear`` (``--quantization int8``);
- ``int4``: ``Int4Linear`` (``--quantization int4``'s layers: half a byte
  a weight plus a byte per 32 for the group scales).

The median pass of ``--reps`` is reported per shape (the first pass warms
up), with the bytes of weights read per second, and the sum over shapes: a
decode step's linears at that many rows.

``--call-sizes`` instead streams the same ~130 MB of int8 weights (~265 MB
of bf16) at one row, split into calls of one size (576, 3072, 49152 or
230400 output columns of 576 inputs): how much a call's size costs the
rate at which the weights are read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from jitney.worker.kernels.cpu import ops as cpu_kernels  # noqa: E402


class TorchLinear(torch.nn.Module):
    """torch's own bf16 linear of one weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


SHAPES = [("qkv_proj", 960, 576, 30), ("o_proj", 576, 576, 30), ("gate_up_proj", 3072, 576, 30),
          ("down_proj", 576, 1536, 30), ("lm_head", 49152, 576, 1)]
MODES = ("bf16", "torch", "int8", "int4")
BYTES_PER_WEIGHT = {"bf16": 2.0, "torch": 2.0, "int8": 1.0, "int4": 0.5 + 1 / 32}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--call-sizes", action="store_true",
                        help="one row, the same bytes a pass split into calls of one size each")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.call_sizes:
        return call_sizes(gen, args.reps)
    print(f"torch threads {torch.get_num_threads()}, bf16 kernel {cpu_kernels.linear_kernel()}, "
          f"int8 path {cpu_kernels.int8_path()}, int4 path {cpu_kernels.int4_path()}")
    print("| rows | shape | out x in | weights | bf16 ms (GB/s) | torch ms (GB/s) | int8 ms (GB/s) "
          "| int4 ms (GB/s) | torch / bf16 | bf16 / int8 | bf16 / int4 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        total = dict.fromkeys(MODES, 0.0)
        for name, n, k, count in SHAPES:
            weights = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(count)]
            layers: dict[str, list[torch.nn.Module]] = {
                "bf16": [cpu_kernels.InvariantLinear(w, None) for w in weights],
                "torch": [TorchLinear(w) for w in weights],
                "int8": [cpu_kernels.Int8Linear(w, None) for w in weights],
                "int4": [cpu_kernels.Int4Linear(w, None) for w in weights]}
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(args.reps + 1):
                for mode, lins in layers.items():
                    started = time.perf_counter()
                    for lin in lins:
                        lin(x)
                    times[mode].append(time.perf_counter() - started)
            med = {mode: statistics.median(times[mode][1:]) for mode in MODES}   # the first pass warms up
            for mode in MODES:
                total[mode] += med[mode]
            cells = " | ".join(f"{med[m] * 1e3:.2f} ({BYTES_PER_WEIGHT[m] * n * k * count / med[m] / 1e9:.0f})"
                               for m in MODES)
            print(f"| {rows} | {name} | {n} x {k} | {count} | {cells} | {med['torch'] / med['bf16']:.2f}x "
                  f"| {med['bf16'] / med['int8']:.2f}x | {med['bf16'] / med['int4']:.2f}x |")
        cells = " | ".join(f"{total[m] * 1e3:.2f}" for m in MODES)
        print(f"| {rows} | **all** | | | {cells} | {total['torch'] / total['bf16']:.2f}x "
              f"| {total['bf16'] / total['int8']:.2f}x | {total['bf16'] / total['int4']:.2f}x |")
    return 0


def call_sizes(gen: torch.Generator, reps: int) -> int:
    """One row through int8 and bf16 linears: GB/s by each call's size, ~130 MB of int8 a pass."""
    k, total = 576, 130e6
    print("| kernel | out x in | MB a call | calls a pass | ms a pass | GB/s | µs a call |\n"
          "|---|---|---|---|---|---|---|")
    for mode in ("int8", "bf16"):
        for n in (576, 3072, 49152, 230400):
            count = max(1, int(total / (n * k)) // (1 if mode == "int8" else 2))
            make = cpu_kernels.Int8Linear if mode == "int8" else cpu_kernels.InvariantLinear
            lins = [make((torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16), None) for _ in range(count)]
            x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
            times = []
            for _ in range(reps + 1):
                started = time.perf_counter()
                for lin in lins:
                    lin(x)
                times.append(time.perf_counter() - started)
            med = statistics.median(times[1:])   # the first pass warms up
            size = BYTES_PER_WEIGHT[mode] * n * k
            print(f"| {mode} | {n} x {k} | {size / 1e6:.2f} | {count} | {med * 1e3:.2f} "
                  f"| {size * count / med / 1e9:.1f} | {med / count * 1e6:.1f} |", flush=True)
            del lins
    return 0


if __name__ == "__main__":
    sys.exit(main())
