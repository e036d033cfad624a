#!/usr/bin/env python3
"""Issue 15's benchmark: the CPU step against its bf16 matmul floor, int8, int4 and llama.cpp, in one run.

    .venv/bin/python bench/cpu_floor.py [--cases NAME ...] [--limit N] [--out FILE] [--json FILE]
    .venv/bin/python bench/cpu_floor.py --smoke        # a tiny random model, a few requests, seconds

Everything below runs side by side in one process's run, one thing at a time:

* ``floor``: the machine's bf16 matmul throughput on the model's own linear
  shapes at ``--floor-rows`` rows (512), through the worker's own kernel
  (``cpu_kernels.InvariantLinear``) and through ``F.linear``. The FLOPs of
  offline-64 are counted from the workload file and the model's config
  (``workload_flops``), per shape; each kernel's throughput over that mix
  (FLOPs / the time each shape's share takes at its measured rate) is
  taken, and the better kernel's is the peak. Floor seconds = FLOPs / peak
  (attention counted at the same peak).
* ``bf16-offline``, ``bf16-online``, ``int8-offline``, ``int8-online``,
  ``int4-offline``, ``int4-online``, ``static-8``: a fresh `jitney serve` per case with its flags, replayed by
  `jitney bench` (``bench/run_benchmarks.run_server_case``).
* ``decode-bf16``, ``decode-int8``, ``decode-int4``: the worker's decode step at batch 1/8/64
  (``bench/decode_step.measure``), model ms and execute ms.
* ``llama-offline``, ``llama-online``: llama.cpp's `llama-server` on the
  bundled GGUF (``bench/llama_server.py``), only where it is on the PATH.

A case that fails (e.g. ``--quantization int8`` before the worker has it) is
reported as failed, with the reason, and the run goes on; the exit status is
then 1. The targets' "met"/"missed" are computed from this run's numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llama_server  # noqa: E402
from bench.report import _table  # noqa: E402
from bench.run_benchmarks import WORKLOADS, computed_prompt_tokens, run_server_case  # noqa: E402
from jitney.client.bench import WorkItem, load_workload  # noqa: E402
from jitney.scheduler.trace import read_trace  # noqa: E402
from jitney.worker.model import ModelConfig  # noqa: E402

BF16 = ["--dtype", "auto"]
INT8 = ["--dtype", "auto", "--quantization", "int8"]
INT4 = ["--dtype", "auto", "--quantization", "int4"]
# name -> (workload, jitney serve flags)
SERVER_CASES: dict[str, tuple[str, list[str]]] = {
    "bf16-offline": ("offline-64.jsonl", BF16),
    "bf16-online": ("online-64.jsonl", BF16),
    "int8-offline": ("offline-64.jsonl", INT8),
    "int8-online": ("online-64.jsonl", INT8),
    "int4-offline": ("offline-64.jsonl", INT4),
    "int4-online": ("online-64.jsonl", INT4),
    "static-8": ("offline-64.jsonl", [*BF16, "--policy", "static", "--max-num-seqs", "8"]),
}
DECODE_CASES: dict[str, dict[str, Any]] = {"decode-bf16": {}, "decode-int8": {"quantization": "int8"},
                                           "decode-int4": {"quantization": "int4"}}
LLAMA_CASES = {"llama-offline": "offline-64.jsonl", "llama-online": "online-64.jsonl"}
ALL_CASES = ["floor", *DECODE_CASES, *SERVER_CASES, *LLAMA_CASES]
DECODE_BATCHES = (1, 8, 64)
# bf16 serving cases whose step traces are read against each step's floor (``step_floors``)
STEP_FLOOR_CASES = ("bf16-offline", "static-8")


# ---------------------------------------------------------------- FLOPs


def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """The model's matmuls as ``(name, in_features, out_features, uses per token)``: each
    layer's fused qkv, o, gate_up and down (``num_layers`` uses), and the head (one use)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    return [("qkv_proj", h, q + 2 * kv, n), ("o_proj", q, h, n), ("gate_up_proj", h, 2 * i, n),
            ("down_proj", i, h, n), ("lm_head", h, cfg.vocab_size, 1)]


def weight_count(cfg: ModelConfig, head: bool = True) -> int:
    """Linear weights a token meets: every layer's, and the head's unless ``head`` is False."""
    return sum(k * n * uses for name, k, n, uses in linear_shapes(cfg) if head or name != "lm_head")


def attention_flops_per_key(cfg: ModelConfig) -> int:
    """FLOPs of one query-key pair over all layers: QK^T and PV, 2 per multiply-add, every head."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of one token's K and V in every layer, ``dtype_bytes`` a value (2: bf16)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def request_flops(cfg: ModelConfig, prompt_tokens: int, max_tokens: int) -> dict[str, int]:
    """Matmul FLOPs of one greedy request of ``prompt_tokens`` + ``max_tokens`` tokens, none cached.

    Positions computed: every prompt token and every output token but the last
    (it is sampled, never fed back): P + M - 1. Each costs 2 x the layers'
    linear weights (bias adds not counted). The head runs only where a token
    is sampled: the prompt's last position and the M - 1 decodes, M in all.
    Attention, causal: the token at position p attends p + 1 keys, 4 x keys x
    heads x head_dim per layer (QK^T and PV, 2 FLOPs a multiply-add each).
    """
    positions = max(0, prompt_tokens + max_tokens - 1)
    keys = positions * (positions + 1) // 2
    return {"positions": positions,
            "linear": 2 * weight_count(cfg, head=False) * positions,
            "head": 2 * cfg.hidden_size * cfg.vocab_size * max_tokens,
            "attention": attention_flops_per_key(cfg) * keys}


def workload_flops(cfg: ModelConfig, items: Iterable[WorkItem]) -> dict[str, Any]:
    """``request_flops`` summed over a workload, plus ``total`` and the matmul FLOPs ``by_shape``."""
    out: dict[str, Any] = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "positions": 0, "linear": 0,
                           "head": 0, "attention": 0}
    for item in items:
        out["requests"] += 1
        out["prompt_tokens"] += len(item.prompt_token_ids)
        out["output_tokens"] += item.max_tokens
        for key, value in request_flops(cfg, len(item.prompt_token_ids), item.max_tokens).items():
            out[key] += value
    out["total"] = out["linear"] + out["head"] + out["attention"]
    # The same matmul FLOPs by shape: each layer shape on every position, the head where one samples.
    out["by_shape"] = {name: 2 * k * n * uses * (out["positions"] if name != "lm_head" else out["output_tokens"])
                       for name, k, n, uses in linear_shapes(cfg)}
    return out


def workload_bytes(cfg: ModelConfig, items: Iterable[WorkItem], dtype_bytes: int = 2) -> dict[str, Any]:
    """Bytes a workload's decodes must read from memory at the least, with weights and cache in
    ``dtype_bytes`` (2: bf16).

    Each decode step reads every linear weight once (the layers' and the head's), whatever its
    batch; a request of M output tokens is M - 1 decode steps after its prefill, one after another,
    so a run takes at least max(M) - 1 of them. Each decode at position p reads the K and V of
    its p keys before it in every layer. Prefill steps (compute-bound) and activations are not
    counted: this is a lower bound on the bytes, as the FLOP count is on the arithmetic.
    """
    weights = dtype_bytes * weight_count(cfg)
    kv_per_token = kv_bytes_per_token(cfg, dtype_bytes)
    steps = keys = 0
    for item in items:
        prompt, m = len(item.prompt_token_ids), item.max_tokens
        steps = max(steps, m - 1)
        # decode j (1 .. m - 1) feeds the token at position prompt + j - 1, attending prompt + j keys
        keys += sum(prompt + j for j in range(1, m))
    return {"weights_per_step": weights, "decode_steps": steps, "weights": weights * steps,
            "kv_per_token": kv_per_token, "kv": kv_per_token * keys, "total": weights * steps + kv_per_token * keys}


def weight_bytes(cfg: ModelConfig, kind: str = "bf16") -> int:
    """Bytes of every linear weight a decode step reads (the layers' and the head's): bf16 two a
    weight; int8 one a weight and a float32 scale an output channel (``cpu_kernels.Int8Linear``)."""
    if kind == "bf16":
        return 2 * weight_count(cfg)
    if kind == "int8":
        return sum((k * n + 4 * n) * uses for _, k, n, uses in linear_shapes(cfg))
    raise ValueError(f"unknown weight kind {kind!r}")


PROMPT_GROUP = "with prompt work"
# decode-only steps by their number of sequences: (group, the least it holds)
DECODE_GROUPS: tuple[tuple[str, int], ...] = (("decode, 32+ sequences", 32), ("decode, 8-31 sequences", 8),
                                              ("decode, 1-7 sequences", 1))


def step_floors(cfg: ModelConfig, steps: Iterable[dict[str, Any]], peak_gflops: float,
                rate_gbs: float) -> dict[str, Any]:
    """Each step of a run's trace (``jitney serve --trace``) against its own floor: the larger of
    its FLOPs at ``peak_gflops`` and its bytes at ``rate_gbs``, with bf16 weights.

    A step's FLOPs: 2 x the layers' weights per token computed, 2 x the head's per sampled row
    (``samples``), 4 x heads x head_dim x layers per query-key pair (``attended_keys``). Its bytes:
    the layers' weights once, whatever its batch, the head's where it samples, and the K/V of each
    chunk's sequence up to the chunk's end (``context_tokens``) in every layer; activations left
    out. A lower bound on each step's time, so their sum bounds the run's model time from below
    under the run's own step plan.

    ``phases_s``: a tighter bound that still holds. A step's linears, its attention and its head
    run one after another (each op on every thread, none overlapping another), so the step takes
    at least the sum of the three phases' floors, each the larger of that phase's FLOPs at the
    peak and its bytes at the rate: a 64-sequence decode cannot hide attention's K/V stream under
    the linears' arithmetic. (Within the linears, every layer weight meets the same rows, so
    their FLOPs and bytes keep one ratio and one floor covers them.)

    Steps without seats (ones that only free) are skipped. Grouped: the steps with prompt work
    (``PROMPT_GROUP``), and the decode-only steps by their number of sequences (``DECODE_GROUPS``)."""
    layer_params = weight_count(cfg, head=False)
    head_params = cfg.hidden_size * cfg.vocab_size
    attention = attention_flops_per_key(cfg)
    kv_per_token = kv_bytes_per_token(cfg)
    flop_s, byte_s = 1 / (peak_gflops * 1e9), 1 / (rate_gbs * 1e9)
    groups: dict[str, dict[str, Any]] = {
        name: {"group": name, "steps": 0, "model_s": 0.0, "floor_s": 0.0, "phases_s": 0.0, "flops_bound": 0}
        for name in (PROMPT_GROUP, *(n for n, _ in DECODE_GROUPS))}
    for step in steps:
        if not step["seats"]:
            continue
        tokens = step["prefill_tokens"] + step["decode_tokens"]
        # (FLOPs, bytes) of each phase: bf16 weights, two bytes each; no head where nothing samples
        phases = [(2 * layer_params * tokens, 2 * layer_params),
                  (2 * head_params * step["samples"], 2 * head_params if step["samples"] else 0),
                  (attention * step["attended_keys"], kv_per_token * step["context_tokens"])]
        flops_s = sum(f for f, _ in phases) * flop_s
        bytes_s = sum(b for _, b in phases) * byte_s
        if step["prefill_tokens"]:
            name = PROMPT_GROUP
        else:
            name = next(n for n, least in DECODE_GROUPS if step["decode_tokens"] >= least)
        g = groups[name]
        g["steps"] += 1
        g["model_s"] += step["model_s"]
        g["floor_s"] += max(flops_s, bytes_s)
        g["phases_s"] += sum(max(f * flop_s, b * byte_s) for f, b in phases)
        g["flops_bound"] += flops_s >= bytes_s
    rows = [g for g in groups.values() if g["steps"]]
    return {"peak_gflops": peak_gflops, "rate_gbs": rate_gbs, "groups": rows,
            "steps": sum(g["steps"] for g in rows), "model_s": sum(g["model_s"] for g in rows),
            "floor_s": sum(g["floor_s"] for g in rows), "phases_s": sum(g["phases_s"] for g in rows)}


def model_config(model: str | None) -> ModelConfig:
    """The worker's ModelConfig of ``model`` (None: the bundled default), read as the worker reads it."""
    from jitney.common.model_files import resolve_model
    from jitney.worker.loader import load_hf_config, model_config_from_hf

    return model_config_from_hf(load_hf_config(resolve_model(model)))


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

    from jitney.worker.cpu_kernels import InvariantLinear

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


# ---------------------------------------------------------------- cases


def _reason(err: BaseException) -> str:
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
                out[name] = {"error": _reason(err), "config": config}
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


def limited(path: Path, limit: int | None, workdir: Path) -> Path:
    """``path`` itself, or its first ``limit`` requests (by arrival) written to ``workdir``."""
    if not limit:
        return path
    out = workdir / f"{path.stem}.first{limit}.jsonl"
    rows = [{"id": i.id, "arrival_s": i.arrival_s, "prompt_token_ids": i.prompt_token_ids,
             "max_tokens": i.max_tokens} for i in load_workload(path)[:limit]]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def smoke_setup(workdir: Path) -> tuple[str, dict[str, Path]]:
    """A tiny random Llama and two small workloads in the format of bench/workloads/."""
    from bench.tiny_models import make_tiny_llama

    model = make_tiny_llama(workdir / "tiny-model", max_position_embeddings=512)
    shapes = {"offline-64.jsonl": [(0.0, 24, 12), (0.0, 9, 20), (0.0, 40, 6), (0.0, 16, 16)],
              "online-64.jsonl": [(0.0, 12, 10), (0.15, 30, 8), (0.3, 7, 12), (0.45, 20, 6)]}
    workloads = {}
    for name, rows in shapes.items():
        path = workdir / f"smoke-{name}"
        path.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": t, "max_tokens": m,
                                            "prompt_token_ids": [(11 * i + 7 * j) % 300 + 3 for j in range(p)]})
                                + "\n" for i, (t, p, m) in enumerate(rows)))
        workloads[name] = path
    return str(model), workloads


# ---------------------------------------------------------------- targets and report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 15's targets, each computed from this run's numbers (``met`` None where one is missing)."""
    cases, decode, floor = res["cases"], res["decode"], res.get("floor")

    def case(name: str, *keys: str) -> float | None:
        value = cases.get(name)
        if not value or "error" in value:
            return None
        for key in keys:
            value = value[key]
        return float(value)  # type: ignore[arg-type]

    def model_ms(name: str, batch: int) -> float | None:
        rows = [r for r in (decode.get(name) or {}).get("rows", []) if r["batch"] == batch]
        return rows[0]["model_ms"] if rows else None

    floor_s = floor.get("floor_s") if floor and "error" not in floor else None
    step = {name: sf["floor_s"] for name, sf in res.get("step_floors", {}).items()}
    phased = {name: sf.get("phases_s") for name, sf in res.get("step_floors", {}).items()}
    data = res.get("decode_bytes")
    int8_bytes = _ratio(data["bf16"] + data["kv"], data["int8"] + data["kv"]) if data else None
    # (target, op, goal, value, the value were every step at its floor, and at its floor in phases:
    # None where no such bound is computed)
    rows = [
        ("continuous (bf16-offline) / static-8 output tok/s", ">=", 3.0,
         _ratio(case("bf16-offline", "output_tok_s"), case("static-8", "output_tok_s")),
         _ratio(step.get("static-8"), step.get("bf16-offline")),
         _ratio(phased.get("static-8"), phased.get("bf16-offline"))),
        ("offline-64 wall (bf16) / bf16 matmul floor", "<=", 1.6, _ratio(case("bf16-offline", "wall_s"), floor_s),
         _ratio(step.get("bf16-offline"), floor_s), _ratio(phased.get("bf16-offline"), floor_s)),
        ("decode step batch 1, model ms: bf16 / int8", ">=", 2.0,
         _ratio(model_ms("decode-bf16", 1), model_ms("decode-int8", 1)), int8_bytes, None),
        ("decode step batch 64, model ms: bf16 / int8 (int8 no slower at large batches)", ">=", 1.0,
         _ratio(model_ms("decode-bf16", 64), model_ms("decode-int8", 64)), None, None),
        ("online-64 TPOT p50: bf16 / int8", ">=", 1.5,
         _ratio(case("bf16-online", "tpot_s", "p50"), case("int8-online", "tpot_s", "p50")), None, None),
        # The low-batch targets, for its optional int4.
        ("decode step batch 1, model ms: bf16 / int4", ">=", 2.0,
         _ratio(model_ms("decode-bf16", 1), model_ms("decode-int4", 1)), None, None),
        ("online-64 TPOT p50: bf16 / int4", ">=", 1.5,
         _ratio(case("bf16-online", "tpot_s", "p50"), case("int4-online", "tpot_s", "p50")), None, None),
    ]
    return [{"target": t, "goal": f"{'≥' if op == '>=' else '≤'} {goal:g}×", "value": v, "at_floors": bound,
             "at_phases": phases, "met": None if v is None else (v >= goal if op == ">=" else v <= goal)}
            for t, op, goal, v, bound, phases in rows]


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def render(res: dict[str, Any]) -> str:
    out = ["# Issue 15: the CPU step near its floor", "",
           "Written by `bench/cpu_floor.py` from one run: every figure below was measured side by side on "
           "the same machine in this run, one case at a time; ratios between them are meaningful, absolute "
           "figures move with the machine's load. bf16 = `--dtype auto` (bfloat16 on a CPU with native "
           "bf16 math); int8 = `--quantization int8`; int4 = `--quantization int4`.", "",
           f"Machine: {res['machine']}. Model: {res['model']}." + (" **Smoke run** (tiny random model, "
                                                                   "tiny workloads): no figure here means anything."
                                                                   if res["smoke"] else ""), ""]
    floor = res.get("floor")
    out += ["## The bf16 matmul floor", ""]
    if floor is None:
        out += ["Not run (`--cases` left it out).", ""]
    elif "error" in floor:
        out += [f"**Failed**: {floor['error']}", ""]
    else:
        pk = floor["peak"]
        fl = floor["flops"]
        share = {name: f / sum(fl["by_shape"].values()) for name, f in fl["by_shape"].items()}
        pass_peaks = ", ".join(f"{v:.0f}" for v in pk["pass_peaks"])
        out += [f"bf16 matmuls of the model's linear shapes at {pk['rows']} rows, {pk['threads']} torch threads, "
                f"best of {pk['reps']} calls in each of {len(pk['passes'])} passes (the run's start and end; "
                f"each pass's peak: {pass_peaks} GFLOP/s), the better pass per shape:", "",
                "| shape | in × out | uses per token | share of offline-64's matmul FLOPs | InvariantLinear GFLOP/s "
                "| F.linear GFLOP/s |", "|---|---|---|---|---|---|"]
        out += [f"| {s['name']} | {s['in']} × {s['out']} | {s['uses']} | {share[s['name']]:.1%} | "
                f"{s['InvariantLinear']:.0f} | {s['F.linear']:.0f} |" for s in pk["shapes"]]
        mix = pk["mix_gflops"]
        out += [f"| offline-64's mix | | | 100% | {mix['InvariantLinear']:.0f} | {mix['F.linear']:.0f} |", "",
                f"Peak: **{pk['peak_gflops']:.0f} GFLOP/s** ({pk['peak_kernel']}, the better over the mix: "
                "FLOPs / Σ each shape's FLOPs at its rate).", ""]
        out += [f"Work of {floor['workload']} ({fl['requests']} requests, {fl['prompt_tokens']} prompt tokens, "
                f"{fl['output_tokens']} output tokens, {fl['positions']} positions computed; no prefix-cache "
                "reuse assumed), counted from the workload file and the model config:", "",
                "| part | GFLOP |", "|---|---|",
                f"| linear layers (2 × layer weights per position) | {fl['linear'] / 1e9:.4g} |",
                f"| head (2 × vocab × hidden per sampled position) | {fl['head'] / 1e9:.4g} |",
                f"| attention (causal, 4 × keys × heads × head_dim per layer) | {fl['attention'] / 1e9:.4g} |",
                f"| **total** | **{fl['total'] / 1e9:.4g}** |", "",
                f"Floor: {fl['total'] / 1e9:.4g} GFLOP / {pk['peak_gflops']:.0f} GFLOP/s = "
                f"**{floor['floor_s']:.3g} s**."]
        wall = (res["cases"].get("bf16-offline") or {}).get("wall_s")
        out += [f"offline-64 (bf16) wall: {wall:.2f} s = **{wall / floor['floor_s']:.2f}× the floor**."
                if wall else "offline-64 (bf16) was not measured, so no ratio to the floor.", ""]
        if "bytes" in floor:
            data, rates = floor["bytes"], ", ".join(f"{v:.1f}" for v in floor["bandwidth_passes"])
            bound = max(floor["floor_s"], floor["bytes_floor_s"])
            out += ["### The bytes floor", "",
                    "Decode steps are bound by memory, not arithmetic: each reads every weight once whatever "
                    "its batch, and each sequence's cache. Counted from the workload file (a lower bound: "
                    "prefill steps and activations left out):", "",
                    "| part | GB |", "|---|---|",
                    f"| weights (bf16, {data['weights_per_step'] / 1e6:.0f} MB) × {data['decode_steps']} decode "
                    f"steps at the least (the longest request's) | {data['weights'] / 1e9:.1f} |",
                    f"| K/V the decodes read ({data['kv_per_token'] / 1e3:.1f} KB a key, all layers) "
                    f"| {data['kv'] / 1e9:.1f} |",
                    f"| **total** | **{data['total'] / 1e9:.1f}** |", "",
                    f"Memory read rate (a float32 sum far above the caches, best of each pass: {rates} GB/s): "
                    f"**{floor['bandwidth_gbs']:.1f} GB/s**. Bytes floor: **{floor['bytes_floor_s']:.3g} s**.",
                    "",
                    f"Both floors are lower bounds on the run; the larger, {bound:.3g} s, is the tighter one."
                    + (f" offline-64 (bf16) wall: **{wall / bound:.2f}×** it." if wall else ""), ""]

    cases = res["cases"]
    ok = [n for n in cases if "error" not in cases[n]]
    failed = [n for n in cases if "error" in cases[n]]
    out += ["## Serving: offline-64 (64 requests at t = 0) and online-64 (Poisson, 1 request/s)", ""]
    for title, names in (("offline-64", ["bf16-offline", "int8-offline", "int4-offline", "static-8",
                                         "llama-offline"]),
                         ("online-64", ["bf16-online", "int8-online", "int4-online", "llama-online"])):
        shown = [n for n in names if n in ok]
        out += [f"### {title}", ""] + (_table(cases, shown) if shown else ["No case of it ran."]) + [""]
        if title == "online-64" and shown:
            out += ["| case | TTFT p99 s | TPOT p90 ms |", "|---|---|---|"]
            out += [f"| {n} | {cases[n]['ttft_s']['p99']:.2f} | {cases[n]['tpot_s']['p90'] * 1000:.1f} |"
                    for n in shown] + [""]
    computed = {n: cases[n]["computed_prompt_tokens"] for n in ok if "computed_prompt_tokens" in cases[n]}
    if computed:
        out += ["Prompt tokens the worker computed (from the step trace): "
                + ", ".join(f"{n} {v}" for n, v in computed.items()) + ".", ""]
    if res.get("step_floors"):
        first = next(iter(res["step_floors"].values()))
        out += ["### Each step against its own floor (from the step traces)", "",
                f"Each step's floor is the larger of its FLOPs at the peak ({first['peak_gflops']:.0f} GFLOP/s) and "
                f"its bytes at the read rate ({first['rate_gbs']:.1f} GB/s): every bf16 weight once (the head's "
                "where the step samples), and the K/V of each chunk's sequence up to the chunk's end "
                "(`step_floors`). Their sum bounds the model time from below under the case's own step plan; model "
                "s is the worker's model time of those steps. *In phases*: the tighter bound of a step's linears, "
                "attention and head run one after another, the sum of each phase's own floor.", "",
                "| case | steps | count | model s | their floors, s | ratio | in phases, s | ratio | "
                "FLOP-bound steps |",
                "|---|---|---|---|---|---|---|---|---|"]
        for name, sf in res["step_floors"].items():
            wall = (cases.get(name) or {}).get("wall_s")
            out += [f"| {name} | {g['group']} | {g['steps']} | {g['model_s']:.2f} | {g['floor_s']:.2f} | "
                    f"{_fmt(_ratio(g['model_s'], g['floor_s']), '.2f', '×')} | {g['phases_s']:.2f} | "
                    f"{_fmt(_ratio(g['model_s'], g['phases_s']), '.2f', '×')} | {g['flops_bound']} |"
                    for g in sf["groups"]]
            out.append(f"| {name} | **all** (wall {_fmt(wall, '.2f', ' s')}) | {sf['steps']} | {sf['model_s']:.2f} | "
                       f"{sf['floor_s']:.2f} | {_fmt(_ratio(sf['model_s'], sf['floor_s']), '.2f', '×')} | "
                       f"{sf['phases_s']:.2f} | {_fmt(_ratio(sf['model_s'], sf['phases_s']), '.2f', '×')} | "
                       f"{sum(g['flops_bound'] for g in sf['groups'])} |")
        out.append("")
    if failed:
        out += ["**Failed cases** (the run went on without them):", "", "| case | flags | reason |", "|---|---|---|"]
        out += [f"| {n} | `{' '.join(cases[n].get('flags', []))}` | {cases[n]['error']} |" for n in failed] + [""]
    if res.get("llama_note"):
        out += [f"llama.cpp: {res['llama_note']}", ""]

    out += ["## Decode step (`bench/decode_step.py`'s measure, B sequences; the modes in turns, median over rounds)",
            ""]
    decode = res["decode"]
    if not decode:
        out += ["Not run (`--cases` left it out).", ""]
    else:
        out += ["| mode | dtype | context | batch | model ms | execute ms | model ms, each round |",
                "|---|---|---|---|---|---|---|"]
        for name, d in decode.items():
            if "error" in d:
                out.append(f"| {name} | **failed**: {d['error']} | | | | | |")
                continue
            out += [f"| {name} | {d['dtype']} | {d['context']} | {r['batch']} | {r['model_ms']:.1f} | "
                    f"{r['execute_ms']:.1f} | {', '.join(f'{v:.1f}' for v in r.get('rounds_model_ms', []))} |"
                    for r in d["rows"]]
        out.append("")

    out += ["## Targets (issue 15, ratios of this run)", "",
            "| target | goal | value | result | at the floors ¹ | in phases ² |", "|---|---|---|---|---|---|"]
    for t in res["targets"]:
        mark = "– (not measured)" if t["met"] is None else ("met" if t["met"] else "**missed**")
        out.append(f"| {t['target']} | {t['goal']} | {_fmt(t['value'], '.2f', '×')} | {mark} | "
                   f"{_fmt(t.get('at_floors'), '.2f', '×')} | {_fmt(t.get('at_phases'), '.2f', '×')} |")
    out += ["", "¹ The ratio were every step at its floor, from this run's figures: continuous / static-8 and "
            "offline-64 / the matmul floor from the step floors above (each case's own step plan); int8 at one "
            "sequence as bytes read a step, bf16 / int8 (every weight and the K/V of the decode cases' context), "
            "the ratio where both read memory at the same rate. Not a target: where a goal lies beyond it, only "
            "a step further from its floor on the other side of the ratio can meet it.",
            "", "² The same from the step floors in phases (linears, attention and head one after another): the "
            "tighter of the two bounds.", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=ALL_CASES, default=None, metavar="CASE",
                        help=f"what to run (default: all): {', '.join(ALL_CASES)}")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random model (bench/tiny_models.py) and 4-request workloads: a plumbing check")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="replay only the first N requests of each workload (plumbing checks; the floor "
                             "then counts those N)")
    parser.add_argument("--floor-rows", type=int, default=512, help="rows of the peak matmuls")
    parser.add_argument("--floor-reps", type=int, default=5)
    parser.add_argument("--decode-context", type=int, default=100)
    parser.add_argument("--decode-reps", type=int, default=10)
    parser.add_argument("--decode-rounds", type=int, default=3,
                        help="rounds of the decode cases, the modes taking turns (median over rounds)")
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server's slots (-np)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "cpu_floor")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="write every figure as JSON here")
    args = parser.parse_args(argv)
    wanted = args.cases or ALL_CASES
    args.workdir.mkdir(parents=True, exist_ok=True)

    model: str | None = None
    workloads = {name: WORKLOADS / name for name in ("offline-64.jsonl", "online-64.jsonl")}
    model_flags: list[str] = []
    if args.smoke:
        model, workloads = smoke_setup(args.workdir)
        model_flags = ["--model", model, "--num-blocks", "256"]
        args.floor_rows, args.floor_reps = min(args.floor_rows, 64), min(args.floor_reps, 3)
        args.decode_context, args.decode_reps = min(args.decode_context, 16), min(args.decode_reps, 2)
        args.decode_rounds = 1
    import torch

    res: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "model": "tiny random Llama (bench/tiny_models.py)" if args.smoke else "the bundled default "
                 "(SmolLM2-135M-Instruct, GGUF)",
        "smoke": args.smoke, "limit": args.limit, "cases": {}, "decode": {}, "floor": None, "llama_note": None,
        "step_floors": {},
    }

    cfg: ModelConfig | None = None  # read once, by the first part that needs it
    if "floor" in wanted:
        print("== floor: bf16 matmul peak on the model's shapes", flush=True)
        try:
            cfg = model_config(model)
            offline = load_workload(limited(workloads["offline-64.jsonl"], args.limit, args.workdir))
            flops = workload_flops(cfg, offline)
            res["floor"] = floor_pass(cfg, flops, args.floor_rows, args.floor_reps,
                                      data=workload_bytes(cfg, offline), bandwidth_mb=64 if args.smoke else 512)
            print(f"  peak {res['floor']['peak']['peak_gflops']:.0f} GFLOP/s, {flops['total'] / 1e9:.1f} GFLOP, "
                  f"floor {res['floor']['floor_s']:.2f} s; read bandwidth {res['floor']['bandwidth_gbs']:.1f} GB/s, "
                  f"bytes floor {res['floor']['bytes_floor_s']:.2f} s", flush=True)
        except Exception as err:  # noqa: BLE001 - reported, the run goes on
            traceback.print_exc()
            res["floor"] = {"error": _reason(err)}

    decode_configs = {name: config for name, config in DECODE_CASES.items() if name in wanted}
    if decode_configs:
        print(f"== {', '.join(decode_configs)}: decode step at batch {', '.join(map(str, DECODE_BATCHES))}, "
              f"{args.decode_rounds} rounds in turns", flush=True)
        res["decode"].update(run_decodes(model, decode_configs, DECODE_BATCHES, args.decode_context,
                                         args.decode_reps, args.decode_rounds))

    for name, (workload, flags) in SERVER_CASES.items():
        if name not in wanted:
            continue
        path = limited(workloads[workload], args.limit, args.workdir)
        all_flags = [*flags, *model_flags]
        try:
            summary = run_server_case(name, path, all_flags, args.workdir)
            summary["workload"] = workload
            summary["computed_prompt_tokens"] = computed_prompt_tokens(Path(summary["trace"]))
            summary.pop("server_stats", None)
            if summary["errors"] or summary["exit_code"]:
                summary = {"error": f"{summary['errors']} request errors, jitney bench exit {summary['exit_code']}",
                           "flags": all_flags, "summary": summary}
        except Exception as err:  # noqa: BLE001
            summary = {"error": _reason(err), "flags": all_flags}
        if "error" in summary:
            print(f"  {name} FAILED: {summary['error']}", flush=True)
        res["cases"][name] = summary

    llama_wanted = [n for n in LLAMA_CASES if n in wanted]
    if llama_wanted:
        exe = llama_server.binary()
        if exe is None:
            res["llama_note"] = "llama-server not on PATH, skipped"
        elif args.smoke:
            res["llama_note"] = "skipped in the smoke run (the tiny model has no GGUF)"
        else:
            from jitney.common.model_files import resolve_model

            files = resolve_model(None)
            gguf = files.directory / (files.gguf_file or "")
            res["llama_note"] = f"{exe}, {gguf.name}, {args.llama_parallel} slots"
            for name in llama_wanted:
                print(f"== {name}: {exe}", flush=True)
                items = load_workload(limited(workloads[LLAMA_CASES[name]], args.limit, args.workdir))
                try:
                    summary = llama_server.run_case(items, gguf, args.workdir, parallel=args.llama_parallel,
                                                    threads=torch.get_num_threads(), exe=exe)
                    summary["workload"] = LLAMA_CASES[name]
                    if summary["errors"]:
                        summary = {"error": f"{summary['errors']} request errors: {summary['failed_requests']}",
                                   "flags": summary["flags"], "summary": summary}
                except Exception as err:  # noqa: BLE001
                    summary = {"error": _reason(err), "flags": [llama_server.BINARY]}
                res["cases"][name] = summary

    if res["floor"] and "error" not in res["floor"]:
        assert cfg is not None  # the floor's first pass read it
        print("== floor: the matmul peak again, at the end of the run", flush=True)
        res["floor"] = floor_pass(cfg, res["floor"]["flops"], args.floor_rows, args.floor_reps, res["floor"])
        fl = res["floor"]
        for name in STEP_FLOOR_CASES:
            case = res["cases"].get(name) or {}
            if "trace" in case and "error" not in case:
                res["step_floors"][name] = step_floors(cfg, read_trace(Path(case["trace"])),
                                                       fl["peak"]["peak_gflops"], fl["bandwidth_gbs"])
    if res["decode"]:
        try:
            cfg = cfg or model_config(model)
            kv = kv_bytes_per_token(cfg) * args.decode_context
            res["decode_bytes"] = {"context": args.decode_context, "kv": kv,
                                   **{kind: weight_bytes(cfg, kind) for kind in ("bf16", "int8")}}
        except Exception:  # noqa: BLE001 - the bound is a note; the decode cases carry their own errors
            traceback.print_exc()
    res["targets"] = targets(res)
    report = render(res)
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    failed = [n for n, c in [*res["cases"].items(), *res["decode"].items()] if "error" in c]
    if res["floor"] and "error" in res["floor"]:
        failed.append("floor")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
