"""int8 against bf16 linear layers on the CPU, per shape of the default model.

    .venv/bin/python bench/int8_linears.py [--rows 1] [--reps 7]

For each linear shape of SmolLM2-135M (30 distinct random weights per layer
shape, one for the head), every weight is called once per pass, so each pass
streams all of them from memory as a decode step does. ``InvariantLinear``
(bf16, the CPU default) and ``Int8Linear`` (``--quantization int8``) take
turns; the median pass of ``--reps`` is reported, with the bytes of weights
read per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from jitney.worker import cpu_kernels  # noqa: E402

SHAPES = [("qkv_proj", 960, 576, 30), ("o_proj", 576, 576, 30), ("gate_up_proj", 3072, 576, 30),
          ("down_proj", 576, 1536, 30), ("lm_head", 49152, 576, 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"rows {args.rows}, torch threads {torch.get_num_threads()}, AMX-INT8 {cpu_kernels.int8_uses_amx()}")
    print("| shape | out x in | weights | bf16 ms | bf16 GB/s | int8 ms | int8 GB/s | bf16 / int8 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k, count in SHAPES:
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(count)]
        layers: dict[str, list[torch.nn.Module]] = {
            "bf16": [cpu_kernels.InvariantLinear(w, None) for w in weights],
            "int8": [cpu_kernels.Int8Linear(w, None) for w in weights]}
        x = torch.randn(args.rows, k, generator=gen).to(torch.bfloat16)
        times: dict[str, list[float]] = {"bf16": [], "int8": []}
        for _ in range(args.reps + 1):
            for mode, lins in layers.items():
                started = time.perf_counter()
                for lin in lins:
                    lin(x)
                times[mode].append(time.perf_counter() - started)
        bf16, int8 = (statistics.median(times[m][1:]) for m in ("bf16", "int8"))   # the first pass warms up
        params = n * k * count
        print(f"| {name} | {n} x {k} | {count} | {bf16 * 1e3:.2f} | {2 * params / bf16 / 1e9:.0f} | "
              f"{int8 * 1e3:.2f} | {params / int8 / 1e9:.0f} | {bf16 / int8:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
