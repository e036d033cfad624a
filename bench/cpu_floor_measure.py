"""bench/cpu_floor.py's measurements: the bf16 matmul peak on the model's shapes, the memory read rate,
and the worker's decode step (``bench/decode_step.py``) in turns."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from bench.cpu_floor_model import linear_shapes
from jitney.worker.models.llama import ModelConfig


# ---------------------------------------------------------------- the matmul peak

def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):   # warm-up
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


KERNELS = ("InvariantLinear", "F.linear")


def measure_shapes(cfg: ModelConfig, rows: int, reps: int) -> dict[str, Any]:
    """bf16 GFLOP/s of each of the model's linear shapes at ``rows`` rows, through each kernel
    (the head as the model runs it: float32 logits out of InvariantLinear). The best of ``reps``
    calls: the floor is a lower bound on the time."""
    import torch
    import torch.nn.functional as F

    from jitney.worker.kernels.cpu.ops import InvariantLinear

    torch.manual_seed(0)
    shapes = []
    with torch.inference_mode():
        for name, k, n, uses in linear_shapes(cfg):
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            x = torch.randn(rows, k).to(torch.bfloat16)
            lin = InvariantLinear(w, None, out_float=name == "lm_head")
            flops = 2 * rows * k * n
            row: dict[str, Any] = {"name": name, "in": k, "out": n, "uses": uses}
            for kernel, fn in zip(KERNELS, (lambda: lin(x), lambda: F.linear(x, w))):
                row[kernel] = flops / _best_seconds(fn, reps) / 1e9
            shapes.append(row)
            del lin, w, x
    return {"rows": rows, "reps": reps, "threads": torch.get_num_threads(), "shapes": shapes}


def peak(shapes: list[dict[str, Any]], by_shape: dict[str, int]) -> dict[str, Any]:
    """Each kernel's GFLOP/s over a workload's mix of shapes (``by_shape``: FLOPs per shape name):
    total FLOPs / the sum of each shape's FLOPs over its measured rate; the better kernel's is the peak."""
    mix = {kernel: sum(by_shape.values()) / sum(by_shape[s["name"]] / s[kernel] for s in shapes)
           for kernel in KERNELS}
    best = max(mix, key=lambda k: mix[k])
    return {"mix_gflops": mix, "peak_gflops": mix[best], "peak_kernel": best}


def measure_bandwidth(megabytes: int, reps: int) -> float:
    """The machine's memory read rate, GB/s: the best of ``reps`` sums of a float32 tensor of
    ``megabytes`` (far above the caches) on torch's threads."""
    import torch

    x = torch.ones(megabytes * 2**20 // 4)
    return x.numel() * 4 / _best_seconds(lambda: x.sum(), reps) / 1e9


def floor_pass(cfg: ModelConfig, flops: dict[str, Any], rows: int, reps: int,
               earlier: dict[str, Any] | None = None, *, data: dict[str, Any] | None = None,
               bandwidth_mb: int | None = None) -> dict[str, Any]:
    """One more pass of ``measure_shapes`` and ``measure_bandwidth``; each shape's rate (and the
    bandwidth) is its best over this pass and ``earlier``'s (the run measures at its start and its
    end, so that a burst of load on a shared machine lowers neither); the peak and floor seconds of
    ``flops`` at those rates, and where ``data`` (``workload_bytes``) is given, its bytes floor.
    ``bandwidth_mb``: the size of the read (default: ``earlier``'s, else 512)."""
    measured = measure_shapes(cfg, rows, reps)
    passes = [*(earlier["peak"]["passes"] if earlier else []), measured["shapes"]]
    best = [{**row, **{k: max(p[i][k] for p in passes) for k in KERNELS}} for i, row in enumerate(measured["shapes"])]
    pk = {**measured, "shapes": best, "passes": passes, **peak(best, flops["by_shape"]),
          "pass_peaks": [peak(p, flops["by_shape"])["peak_gflops"] for p in passes]}
    out = {"peak": pk, "flops": flops, "workload": "offline-64", "floor_s": flops["total"] / (pk["peak_gflops"] * 1e9)}
    data = data if data is not None else (earlier or {}).get("bytes")
    if data is not None:
        mb = bandwidth_mb or (earlier or {}).get("bandwidth_mb", 512)
        rates = [*((earlier or {}).get("bandwidth_passes") or []), measure_bandwidth(mb, reps)]
        out.update(bytes=data, bandwidth_mb=mb, bandwidth_passes=rates, bandwidth_gbs=max(rates),
                   bytes_floor_s=data["total"] / (max(rates) * 1e9))
    return out


# ---------------------------------------------------------------- the decode cases

def failure_reason(err: BaseException) -> str:
    """A failure's reason on one line: the error's own last lines that say "error" (a server's log
    tail included), fit for a markdown table cell."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    tail = [ln for ln in lines if "error" in ln.lower()][-2:] or lines[-2:]
    text = " / ".join(ln.strip() for ln in tail)
    return f"{type(err).__name__}: {text[:300]}".replace("|", "\\|")


def run_decodes(model: str | None, configs: dict[str, dict[str, Any]], batches: Iterable[int], context: int,
                reps: int, rounds: int) -> dict[str, dict[str, Any]]:
    """The worker's decode step (``bench/decode_step.py``) at each batch size for each of ``configs``:
    the modes take turns (``rounds`` rounds of every batch size and mode, so the machine's
    load swings reach them alike); per mode and batch, the median over rounds of model and
    execute ms (each round's figure is itself the median of ``reps`` steps)."""
    from bench.decode_step import make_runner, measure

    out: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {}
    try:
        for name, config in configs.items():
            try:
                runners[name] = make_runner("auto", model=model, **config)
            except Exception as err:  # noqa: BLE001 - reported, the other modes go on
                traceback.print_exc()
                out[name] = {"error": failure_reason(err), "config": config}
        seen: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for batch in batches:
                for name, runner in runners.items():
                    seen.setdefault((name, batch), []).append(measure(runner, batch, context, reps))
        for name, runner in runners.items():
            rows = []
            for batch in batches:
                got = seen[(name, batch)]
                rows.append({"batch": batch, "model_ms": statistics.median(m for m, _ in got) * 1000,
                             "execute_ms": statistics.median(t for _, t in got) * 1000,
                             "rounds_model_ms": [m * 1000 for m, _ in got]})
                print(f"  {name} batch {batch}: model {rows[-1]['model_ms']:.1f} ms "
                      f"(rounds {', '.join(f'{m * 1000:.1f}' for m, _ in got)})", flush=True)
            dtype = str(next(runner.model.parameters()).dtype).removeprefix("torch.")
            out[name] = {"dtype": dtype, "context": context, "reps": reps, "rounds": rounds,
                         "config": configs[name], "rows": rows}
    finally:
        runners.clear()
        gc.collect()
    return out
