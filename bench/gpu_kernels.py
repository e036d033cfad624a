#!/usr/bin/env python3
"""Kernel launch choices measured on the card: what ``worker/kernels/triton/tuned/<card>.json`` is made of.

    python bench/gpu_kernels.py --out $OUT/kernels.md --json $OUT/kernels.json --tuned-dir $OUT/tuned
        [--shapes 1b 135m] [--budget-s 200]

On a CUDA machine (bench/gpu_run.sh runs it before bench/gpu.py, which then
reads the file through ``$JITNEY_TUNED_CONFIGS``). Timed on the device:
CUDA events around replays of a CUDA graph of many calls, so launch latency
from Python is out, as in the worker's graphs.

1. **Skinny linears**: for each weight matrix shape of the model shapes
   (qkv, o, gate_up, down, head), every candidate launch config of
   ``triton_skinny`` at one row, against cuBLAS. The calls cycle through
   enough copies of the weight that none stays in L2, as in a real step
   where each layer reads its own. The best config per shape, then rows
   1..64 with it, against cuBLAS.
2. **Attention**: one 2048-token prefill of a fresh sequence through the
   paged cache, per candidate (rows per tile, keys per trip, warps,
   stages), per head layout; decode launches at 64 sequences of 128 keys,
   per (warps, stages).
3. **LoRA** (measured only; nothing is tuned from it): for each PEFT module's
   weight shape (q/o, k/v, gate/up, down), at 1, 32 and 256 rows spread over
   4 rank-16 adapters, the base linear (cuBLAS) against the Triton
   ``lora_add_triton`` onto its output (the step's ``lora_blocks`` made once
   apart, as a step shares them over every linear) and against the torch path
   ``LoraSlots.apply`` runs today (``lora_delta``, then the add). The base
   weights cycle through copies as in the skinny sweep, each copy with its own
   adapters (all slots of a module: 80 / N of its weight's bytes, so they may
   stay in L2).

``choose`` turns the measurements into the tuned file (the rule is in its
docstring); ``--from-json`` reapplies it to a saved report without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.gpu_sections.checkpoints import SHAPES  # noqa: E402
from bench.gpu_sections.plumbing import ensure_jitney_importable, log  # noqa: E402

SKINNY_CANDIDATES = [*((bn, bk, w, s) for bn in (16, 32, 64) for bk in (128, 256) for w, s in ((4, 3), (4, 4), (8, 4))),
                     (16, 512, 4, 3), (16, 512, 4, 4)]
ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
LORA_ROWS: tuple[int, ...] = (1, 32, 256)
LORA_RANK, LORA_ADAPTERS = 16, 4
# (rows per tile, keys per trip, warps, stages); the first is the built-in choice
ATTENTION_CANDIDATES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3), (64, 32, 4, 3), (128, 64, 4, 3),
                        (128, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3)]
DECODE_ATTENTION_CANDIDATES = [(None, None), (2, 2), (4, 2), (4, 3), (8, 2)]
L2_BYTES = 128 * 2**20   # more than any card's L2: the calls' weights never all fit
PREFILL_TOKENS = 2048
DEVICE = "cuda"   # "cpu" with --smoke: the plumbing under the Triton interpreter, one call per timing


def linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each weight matrix of a model shape."""
    spec = SHAPES[shape]
    h, i = spec["hidden_size"], spec["intermediate_size"]
    nh, kvh = spec["num_attention_heads"], spec["num_key_value_heads"]
    d = h // nh
    return {"qkv": ((nh + 2 * kvh) * d, h), "o": (h, nh * d), "gate_up": (2 * i, h), "down": (h, i),
            "head": (49152 if DEVICE == "cuda" else 256, h)}


def graph_seconds(call: Callable[[int], Any], reps: int = 24, replays: int = 5) -> float:
    """Device seconds per ``call(i)``: a CUDA graph of ``reps`` calls, replayed ``replays`` times."""
    import torch

    if DEVICE == "cpu":
        started = time.perf_counter()
        call(0)
        return time.perf_counter() - started
    for i in range(reps):   # compile, and warm cuBLAS, outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / (reps * replays)


def sweep_skinny(shapes: list[str], report: dict[str, Any], deadline: float) -> None:
    import torch

    from jitney.worker.kernels.triton import skinny as triton_skinny

    rows_table: list[dict[str, Any]] = []
    report["skinny_rows_table"] = rows_table
    seen: set[tuple[int, int]] = set()
    for shape in shapes:
        for name, (n, k) in linear_shapes(shape).items():
            if (n, k) in seen:
                continue
            seen.add((n, k))
            nbytes = n * k * 2
            copies = max(2, min(32, math.ceil(L2_BYTES / nbytes)))
            weights = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = {m: torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for m in ROWS}
            outs = {m: torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16) for m in ROWS}
            cublas1 = graph_seconds(lambda i: torch.matmul(x[1], weights[i % copies].T, out=outs[1]))
            results = []
            for cand in SKINNY_CANDIDATES:
                if time.monotonic() > deadline:
                    break
                triton_skinny.CONFIGS[(n, k)] = triton_skinny.SkinnyConfig(*cand)
                try:
                    sec = graph_seconds(lambda i: triton_skinny.skinny_linear(x[1], weights[i % copies], out=outs[1],
                                                                              check=False))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile/fit is skipped
                    log(f"   skinny {n}x{k} {cand}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                results.append((sec, cand))
            results.sort()
            sec, cand = results[0]
            triton_skinny.CONFIGS[(n, k)] = triton_skinny.SkinnyConfig(*cand)
            log(f"   skinny {shape} {name} {n}x{k}: best {cand} {sec * 1e6:.1f} us ({nbytes / sec / 1e9:.0f} GB/s), "
                f"cuBLAS {cublas1 * 1e6:.1f} us ({nbytes / cublas1 / 1e9:.0f} GB/s)")
            report.setdefault("skinny_candidates", []).append(
                {"shape": shape, "layer": name, "n": n, "k": k, "cublas_s": cublas1,
                 "candidates": [{"config": list(c), "s": s} for s, c in results]})
            for m in ROWS:
                if time.monotonic() > deadline:
                    break
                sk = graph_seconds(lambda i: triton_skinny.skinny_linear(x[m], weights[i % copies], out=outs[m],
                                                                         check=False))
                cb = graph_seconds(lambda i: torch.matmul(x[m], weights[i % copies].T, out=outs[m]))
                rows_table.append({"shape": shape, "layer": name, "n": n, "k": k, "rows": m, "skinny_s": sk,
                                   "cublas_s": cb, "gbps_skinny": nbytes / sk / 1e9, "gbps_cublas": nbytes / cb / 1e9})
            del weights
            triton_skinny.CONFIGS.pop((n, k), None)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


def paged_inputs(tokens: int, nh: int, kvh: int, d: int, block_size: int = 16) -> dict[str, Any]:
    import torch

    blocks = -(-tokens // block_size)
    k_cache = torch.randn(blocks, block_size, kvh, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(tokens, nh, d, device=DEVICE, dtype=torch.bfloat16)
    return {"q": q, "k": k_cache, "v": v_cache, "out": torch.empty_like(q),
            "qsl": torch.tensor([0, tokens], device=DEVICE, dtype=torch.int32),
            "lens": torch.tensor([tokens], device=DEVICE, dtype=torch.int32),
            "table": torch.arange(blocks, device=DEVICE, dtype=torch.int32)[None, :]}


def sweep_attention(shapes: list[str], report: dict[str, Any], deadline: float) -> None:
    import torch

    from jitney.worker.attention import triton as ta

    layouts = sorted({(SHAPES[s]["num_attention_heads"], SHAPES[s]["num_key_value_heads"],
                       SHAPES[s]["hidden_size"] // SHAPES[s]["num_attention_heads"]) for s in shapes}, reverse=True)
    tokens = PREFILL_TOKENS
    rows = []
    defaults = (ta.PREFILL_ROWS, ta.BLOCK_N, dict(ta.LAUNCH))
    for nh, kvh, d in layouts:
        t = paged_inputs(tokens, nh, kvh, d)
        flops = 4 * tokens * (tokens + 1) / 2 * nh * d
        for cand in ATTENTION_CANDIDATES:
            if time.monotonic() > deadline:
                break
            ta.PREFILL_ROWS, ta.BLOCK_N = cand[0], cand[1]
            ta.LAUNCH["prefill"] = (cand[2], cand[3])
            try:
                sec = graph_seconds(lambda i: ta.paged_attention(t["q"], t["k"], t["v"], t["qsl"], t["lens"],
                                                                 t["table"], d**-0.5, tokens, out=t["out"],
                                                                 check=False), reps=8, replays=3)
            except Exception as exc:  # noqa: BLE001
                log(f"   attention {nh}/{kvh} {cand}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append({"heads": [nh, kvh, d], "config": list(cand), "s": sec, "tflops": flops / sec / 1e12})
        ours = [r for r in rows if r["heads"] == [nh, kvh, d]]
        if ours:
            fastest = min(ours, key=lambda r: r["s"])
            log(f"   attention prefill {tokens} ({nh}/{kvh}): best {fastest['config']} {fastest['s'] * 1e6:.0f} us "
                f"({fastest['tflops']:.0f} TFLOP/s)")
        del t
    report["attention_prefill"] = rows
    ta.PREFILL_ROWS, ta.BLOCK_N = defaults[0], defaults[1]
    ta.LAUNCH.update(defaults[2])
    # Decode launches: 64 sequences of 128 keys.
    nh, kvh, d = layouts[0]
    seqs, ctx = (64, 128) if DEVICE == "cuda" else (4, 32)
    blocks = ctx // 16
    k_cache = torch.randn(seqs * blocks, 16, kvh, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(seqs, nh, d, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(seqs + 1, device=DEVICE, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, device=DEVICE, dtype=torch.int32)
    table = torch.arange(seqs * blocks, device=DEVICE, dtype=torch.int32).view(seqs, blocks)
    dec = []
    for launch in DECODE_ATTENTION_CANDIDATES:
        ta.LAUNCH["decode"] = launch
        sec = graph_seconds(lambda i: ta.paged_attention(q, k_cache, v_cache, qsl, lens, table, d**-0.5, 1, out=out,
                                                         check=False))
        dec.append({"config": list(launch), "s": sec})
        log(f"   attention decode {seqs}x{ctx} ({nh}/{kvh}) {launch}: {sec * 1e6:.1f} us")
    report["attention_decode"] = dec
    ta.LAUNCH.update(defaults[2])


def lora_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each PEFT module's weight, one module per shape (q and o, k and v, gate and up agree)."""
    spec = SHAPES[shape]
    h, i = spec["hidden_size"], spec["intermediate_size"]
    nh, kvh = spec["num_attention_heads"], spec["num_key_value_heads"]
    d = h // nh
    return {"q/o": (nh * d, h), "k/v": (kvh * d, h), "gate/up": (i, h), "down": (h, i)}


def sweep_lora(shapes: list[str], report: dict[str, Any], deadline: float) -> None:
    import torch

    from jitney.worker.kernels.triton.lora import lora_add_triton, lora_blocks
    from jitney.worker.layers.lora import lora_delta

    rows_table: list[dict[str, Any]] = []
    report["lora"] = rows_table
    slots_n, dt = LORA_ADAPTERS + 1, torch.bfloat16
    for shape in shapes:
        for name, (n, k) in lora_shapes(shape).items():
            copies = max(2, min(32, math.ceil(L2_BYTES / (n * k * 2))))
            weights = [torch.randn(n, k, device=DEVICE, dtype=dt) * 0.02 for _ in range(copies)]
            a = [torch.randn(slots_n, LORA_RANK, k, device=DEVICE, dtype=dt) * 0.02 for _ in range(copies)]
            b = [torch.randn(slots_n, n, LORA_RANK, device=DEVICE, dtype=dt) * 0.02 for _ in range(copies)]
            scale = torch.full((slots_n,), 2.0, device=DEVICE)
            for m in LORA_ROWS:
                if time.monotonic() > deadline:
                    break
                x = torch.randn(m, k, device=DEVICE, dtype=dt)
                y = torch.zeros(m, n, device=DEVICE, dtype=dt)
                slots = (torch.arange(m, device=DEVICE, dtype=torch.int32) % LORA_ADAPTERS) + 1
                blocks = lora_blocks(slots, slots_n)

                def torch_path(i: int) -> None:
                    y.copy_((y.float() + lora_delta(x, a[i % copies], b[i % copies], scale, slots)).to(dt))

                try:
                    entry: dict[str, Any] = {
                        "shape": shape, "module": name, "n": n, "k": k, "rows": m,
                        "base_s": graph_seconds(lambda i: torch.matmul(x, weights[i % copies].T, out=y)),
                        "triton_s": graph_seconds(lambda i: lora_add_triton(
                            y, 0, x, a[i % copies], b[i % copies], scale, slots, blocks, check=False)),
                        "blocks_s": graph_seconds(lambda i: lora_blocks(slots, slots_n)),
                        "torch_s": graph_seconds(torch_path)}
                except Exception as exc:  # noqa: BLE001 - one shape's failure leaves the others' figures
                    log(f"   lora {shape} {name} rows {m}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                rows_table.append(entry)
                log(f"   lora {shape} {name} {n}x{k} rows {m}: base {entry['base_s'] * 1e6:.1f} us, "
                    f"triton +{entry['triton_s'] * 1e6:.1f} us, torch +{entry['torch_s'] * 1e6:.1f} us")
            del weights, a, b
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


WIN = 0.97   # a skinny launch must take at most this fraction of cuBLAS's time to be used


def choose(report: dict[str, Any]) -> dict[str, Any]:
    """The tuned file's contents from a report's measurements.

    skinny: per weight shape, its fastest candidate at one row, kept up to the most rows
    at which it beat cuBLAS (by ``WIN``) at that and every smaller measured row count;
    shapes where it never did are left to cuBLAS. attention: per head layout, its fastest
    prefill launch; "*" (other layouts): the fastest summed over the layouts; decode: the
    fastest decode launch, for all.
    """
    tuned: dict[str, Any] = {"device": report["card"]}
    skinny: dict[str, list[int]] = {}
    for entry in report.get("skinny_candidates", []):
        if not entry["candidates"]:
            continue
        best = min(entry["candidates"], key=lambda c: c["s"])["config"]
        table = sorted((r for r in report.get("skinny_rows_table", []) if (r["n"], r["k"]) == (entry["n"], entry["k"])),
                       key=lambda r: r["rows"])
        max_rows = 0
        for r in table:
            if r["skinny_s"] > WIN * r["cublas_s"]:
                break
            max_rows = r["rows"]
        if max_rows:
            skinny[f"{entry['n']}x{entry['k']}"] = [*best, max_rows]
    if "skinny_candidates" in report:
        tuned["skinny"] = skinny
        tuned["skinny_rows"] = max((v[-1] for v in skinny.values()), default=0)
    prefill = report.get("attention_prefill", [])
    decode = min(report.get("attention_decode", []), key=lambda r: r["s"], default=None)
    if prefill:
        layouts = sorted({tuple(r["heads"]) for r in prefill}, reverse=True)
        totals: dict[tuple[int, ...], list[float]] = {}
        attention: dict[str, Any] = {}
        for r in prefill:
            totals.setdefault(tuple(r["config"]), []).append(r["s"])
        for heads in layouts:
            ours = min((r for r in prefill if tuple(r["heads"]) == heads), key=lambda r: r["s"])
            attention[f"{heads[0]}/{heads[1]}"] = _attention_entry(ours["config"], decode)
        complete = {c: float(sum(t)) for c, t in totals.items() if len(t) == len(layouts)}
        if complete:
            fastest = min(complete.items(), key=lambda item: item[1])[0]
            attention["*"] = _attention_entry(list(fastest), decode)
        tuned["attention"] = attention
    return tuned


def _attention_entry(config: list[int], decode: dict[str, Any] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"prefill_rows": config[0], "block_n": config[1], "prefill": config[2:4]}
    if decode is not None:
        entry["decode"] = decode["config"]
    return entry


def render(report: dict[str, Any]) -> str:
    lines = [f"# Kernel launch choices on {report['card']}", "", f"{report['date']}; torch {report['torch']}, "
             f"triton {report['triton']}; `bench/gpu_kernels.py` in {report['elapsed_s']:.0f} s.", ""]
    lines += ["## Skinny linears against cuBLAS (device time per call, weights never in L2)", "",
              "| shape | layer | N x K | rows | skinny us | cuBLAS us | skinny GB/s | cuBLAS GB/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report.get("skinny_rows_table", []):
        lines.append(f"| {r['shape']} | {r['layer']} | {r['n']}x{r['k']} | {r['rows']} | {r['skinny_s'] * 1e6:.1f} | "
                     f"{r['cublas_s'] * 1e6:.1f} | {r['gbps_skinny']:.0f} | {r['gbps_cublas']:.0f} |")
    lines += ["", "## Attention, one 2048-token prefill (fastest five per head layout)", "",
              "| heads | rows, keys/trip, warps, stages | us | TFLOP/s |", "|---|---|---|---|"]
    for heads in sorted({tuple(r["heads"]) for r in report.get("attention_prefill", [])}, reverse=True):
        ours = sorted((r for r in report["attention_prefill"] if tuple(r["heads"]) == heads), key=lambda r: r["s"])
        for r in ours[:5]:
            lines.append(f"| {heads[0]}/{heads[1]} | {r['config']} | {r['s'] * 1e6:.0f} | {r['tflops']:.0f} |")
        base = [r for r in ours if r["config"][:2] == [64, 64] and r["config"][2:] == [4, 3]]
        if base:
            lines.append(f"| {heads[0]}/{heads[1]} | before: [64, 64, 4, 3] | {base[0]['s'] * 1e6:.0f} | "
                         f"{base[0]['tflops']:.0f} |")
    lines += ["", "## Decode attention, 64 sequences x 128 keys", "", "| warps, stages | us |", "|---|---|"]
    for r in report.get("attention_decode", []):
        lines.append(f"| {r['config']} | {r['s'] * 1e6:.1f} |")
    lines += ["", "## LoRA: one module's delta beside its base linear (rows spread over 4 rank-16 adapters)", "",
              "| shape | module | N x K | rows | base us | + Triton us | + torch us | Triton / base | blocks us |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("lora", []):
        lines.append(f"| {r['shape']} | {r['module']} | {r['n']}x{r['k']} | {r['rows']} | {r['base_s'] * 1e6:.1f} | "
                     f"{r['triton_s'] * 1e6:.1f} | {r['torch_s'] * 1e6:.1f} | {r['triton_s'] / r['base_s']:.2f} | "
                     f"{r['blocks_s'] * 1e6:.1f} |")
    lines += ["", "## Chosen", "", "```json", json.dumps(report.get("tuned", {}), indent=1), "```", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1b", "135m"])
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--tuned-dir", type=Path, required=True, help="where the card's tuned JSON file is written")
    p.add_argument("--skip", nargs="*", default=[], choices=["skinny", "attention", "lora"])
    p.add_argument("--smoke", action="store_true",
                   help="CPU, under TRITON_INTERPRET=1: the plumbing with two candidates each (tests)")
    p.add_argument("--from-json", type=Path, default=None, metavar="REPORT",
                   help="measure nothing: write the tuned file (and --out) from an earlier run's --json")
    args = p.parse_args()
    if args.from_json is not None:
        write_outputs(json.loads(args.from_json.read_text()), args)
        return 0
    if args.smoke:
        global DEVICE, SKINNY_CANDIDATES, ATTENTION_CANDIDATES, DECODE_ATTENTION_CANDIDATES, ROWS, PREFILL_TOKENS
        global LORA_ROWS
        DEVICE, PREFILL_TOKENS, LORA_ROWS = "cpu", 64, (1, 2)
        SKINNY_CANDIDATES, ATTENTION_CANDIDATES = SKINNY_CANDIDATES[:2], ATTENTION_CANDIDATES[:2]
        DECODE_ATTENTION_CANDIDATES, ROWS = DECODE_ATTENTION_CANDIDATES[:2], (1, 2)
    ensure_jitney_importable()
    import datetime

    import torch
    import triton

    started = time.monotonic()
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke)"
    report: dict[str, Any] = {"card": card, "torch": torch.__version__, "triton": triton.__version__,
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    # Each section measures until its share of the budget is spent; one that fails is logged and the rest run.
    sections = (("skinny", "skinny linears", sweep_skinny, 0.4), ("attention", "attention", sweep_attention, 0.75),
                ("lora", "LoRA kernels", sweep_lora, 0.95))
    for name, title, sweep, share in sections:
        if name in args.skip:
            continue
        log(f"== {title}")
        try:
            sweep(args.shapes, report, started + share * args.budget_s)
        except Exception as exc:  # noqa: BLE001
            log(f"!! {name}: {type(exc).__name__}: {exc}")
        report["elapsed_s"] = time.monotonic() - started
        write_outputs(report, args)
    log(f"tuned: {json.dumps(report.get('tuned', {}))}")
    return 0


def write_outputs(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The tuned file (``choose`` of the report, in ``--tuned-dir``), the report's markdown and its JSON."""
    from jitney.worker.runner import tuned_configs

    tuned = report["tuned"] = choose(report)
    args.tuned_dir.mkdir(parents=True, exist_ok=True)
    (args.tuned_dir / tuned_configs.file_name(report["card"])).write_text(json.dumps(tuned, indent=1) + "\n")
    args.out.write_text(render(report))
    args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
