"""Real-size models on this CPU (issue 42): Llama-3.2-1B's and Qwen3-4B's shapes, bf16 and int8,
every step kind against its floor, and the first request after an idle gap.

    python bench/real_shapes.py [--models llama-3.2-1b qwen3-4b] [--kinds bf16 int8] [--repeats 3]
                                [--tokens 64] [--streams 4] [--idle 60] [--context 128]
                                [--checkpoints DIR] [--traces DIR] [--json FILE]

Each model is a random-weight bf16 checkpoint with the real model's shapes, whole
(``bench/families.py``'s ``make_model``; kept under ``--checkpoints DIR`` to reuse across runs).
In one run, one thing at a time:

* **read rate**: a 1 GiB float32 sum on torch's threads (``cpu_floor_measure.measure_bandwidth``),
  at each model's start and end; the best is the floors' rate. A 2-thread torch reduction reads
  far more than numpy's one thread does, so this is the rate the worker can reach.
* **matmul peak**: bf16 GFLOP/s on the model's own linear shapes at 512 rows (``measure_shapes``),
  the prompt steps' floor.
* **serving**, per kind, a fresh ``jitney serve --trace`` (the default batch-invariant kernels;
  ``--quantization int8`` for int8), replayed with `jitney bench`'s client (greedy, ignore_eos,
  ``--tokens`` tokens each), in phases:
    - ``batch``: the first 16 requests of offline-64 at once, ``--repeats`` times: wall, TPOT;
    - ``stream``: the first ``--streams`` of them one at a time: each TPOT against its floor
      (per decode step, the weights' bytes and the K/V up to its position, at the read rate);
    - ``idle``: ``--idle`` seconds with nothing to do, then one request, then another at once.
  Each phase's steps (told apart by their sequence ids) against their floors (``step_floors``).
* **breakdown**, per kind, in this process once the server has stopped: the worker's decode step
  at 1 and 16 sequences of ``--context`` tokens (``bench/decode_step.py``: model and execute ms),
  then the same decode steps after ``--idle`` seconds idle in this process (a slowdown here is the
  machine's, not the server's); then the step's parts on their own, each against its bytes at the
  read rate: every layer's four linears (distinct weights, so they stream from memory as in a
  step), the head, and attention over the step's context. ``rest`` = model - those parts (norms,
  rope, the activation, residuals); ``host`` = execute - model.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_floor_measure import _best_seconds, measure_bandwidth, measure_shapes, peak  # noqa: E402
from bench.cpu_floor_model import (kv_bytes_per_token, linear_shapes, model_config, step_floors,  # noqa: E402
                                   weight_bytes, weight_bytes_split, workload_flops)
from bench.families import make_model  # noqa: E402
from jitney.client.bench import Outcome, WorkItem, load_workload, replay, summarize  # noqa: E402
from jitney.scheduler.core.trace import read_trace  # noqa: E402
from jitney.worker.models.llama import ModelConfig  # noqa: E402
from tests.support.server_harness import ROOT, running_server  # noqa: E402

WORKLOAD = ROOT / "bench" / "workloads" / "offline-64.jsonl"
MODELS = ("llama-3.2-1b", "qwen3-4b")
KINDS = ("bf16", "int8")
BATCH = 16
BANDWIDTH_MB = 1024


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _tpot(o: Outcome) -> float:
    return (o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1)


def stream_floor_s(cfg: ModelConfig, kind: str, item: WorkItem, rate_gbs: float) -> float:
    """A one-stream request's TPOT floor: its decode steps' mean of (the weights' bytes + the
    K/V of the keys before the fed token) at ``rate_gbs``; decode j feeds position P + j - 1."""
    prompt, m = len(item.prompt_token_ids), item.max_tokens
    weights, kv = weight_bytes(cfg, kind), kv_bytes_per_token(cfg)
    return statistics.fmean(weights + kv * (prompt + j) for j in range(1, m)) / (rate_gbs * 1e9)


# ---------------------------------------------------------------- serving

def serve_phases(model: Path, kind: str, items: list[WorkItem], ns: argparse.Namespace,
                 scratch: Path) -> dict[str, Any]:
    """One server, the phases in order; their outcomes and the steps of each (by seq id)."""
    trace = (ns.traces or scratch) / f"trace-{model.name}-{kind}.jsonl"
    flags = ["--model", str(model), "--no-weights-cache", "--dtype", "bfloat16", "--trace", str(trace),
             *(["--quantization", kind] if kind != "bf16" else [])]
    phases: list[tuple[str, list[Outcome], float]] = []
    with running_server(flags, scratch, startup_timeout=1200) as server:
        def run(name: str, batch: list[WorkItem], concurrency: int | None) -> None:
            outcomes, wall = asyncio.run(replay(server.target, batch, concurrency, show_progress=False))
            bad = [o.error for o in outcomes if not o.ok]
            if bad:
                raise RuntimeError(f"{kind} {name}: {len(bad)} requests failed: {bad[0]}")
            phases.append((name, outcomes, wall))
            print(f"  {kind} {name}: wall {wall:.2f} s, TPOT p50 "
                  f"{statistics.median(_tpot(o) for o in outcomes) * 1e3:.1f} ms", flush=True)

        for r in range(ns.repeats):
            run(f"batch-{r + 1}", items[:BATCH], None)
        run("stream", items[:ns.streams], 1)
        time.sleep(ns.idle)
        run("after-idle", items[:1], 1)
        run("after-idle-next", items[1:2], 1)
        log = server.log()
    if "Traceback" in log:
        raise RuntimeError(f"{kind}: the server logged a traceback:\n{log[-4000:]}")
    steps = read_trace(trace)
    out: dict[str, Any] = {"phases": {}}
    first = 1
    for name, outcomes, wall in phases:
        ids = range(first, first + len(outcomes))
        first += len(outcomes)
        own = [s for s in steps if s["seats"] and all(seq in ids for seq in s["seats"])]
        out["phases"][name] = {"outcomes": outcomes, "wall_s": wall, "steps": own}
    return out


def phase_report(cfg: ModelConfig, kind: str, got: dict[str, Any], peak_gflops: float,
                 rate_gbs: float) -> dict[str, Any]:
    """The phases' figures: batch walls (their median and spread), TPOTs against floors, the idle
    request against the stream's, and each phase's steps against their floors."""
    phases = got["phases"]
    batch = [p for name, p in phases.items() if name.startswith("batch-")]
    walls = [p["wall_s"] for p in batch]
    tpots = [summarize(p["outcomes"], p["wall_s"])["tpot_s"] for p in batch]
    report: dict[str, Any] = {
        "batch16": {"walls_s": [round(w, 3) for w in walls], "median_s": round(statistics.median(walls), 3),
                    "spread": round((max(walls) - min(walls)) / statistics.median(walls), 3),
                    "tpot_p50_ms": [_ms(t["p50"]) for t in tpots], "tpot_p99_ms": [_ms(t["p99"]) for t in tpots]}}
    streams = []
    for name in ("stream", "after-idle", "after-idle-next"):
        for o in phases[name]["outcomes"]:
            floor = stream_floor_s(cfg, kind, o.item, rate_gbs)
            gaps = [b - a for a, b in zip(o.token_times, o.token_times[1:])]
            streams.append({"phase": name, "id": o.item.id, "prompt": len(o.item.prompt_token_ids),
                            "tpot_ms": _ms(_tpot(o)), "floor_ms": _ms(floor), "over_floor": round(_tpot(o) / floor, 3),
                            "first8_itl_ms": _ms(statistics.fmean(gaps[:8])),
                            "rest_itl_ms": _ms(statistics.fmean(gaps[8:])) if gaps[8:] else None})
    report["streams"] = streams
    stream = [s for s in streams if s["phase"] == "stream"]
    report["stream_over_floor_median"] = statistics.median(s["over_floor"] for s in stream)
    idle = next(s for s in streams if s["phase"] == "after-idle")
    same = next((s for s in stream if s["id"] == idle["id"]), stream[0])
    report["idle_tpot_ratio"] = round(idle["tpot_ms"] / same["tpot_ms"], 3)
    report["steps"] = {name: step_floors(cfg, p["steps"], peak_gflops, rate_gbs, kind)
                       for name, p in phases.items() if name in ("batch-1", "stream", "after-idle")}
    return report


# ---------------------------------------------------------------- the breakdown

def part_times(cfg: ModelConfig, kind: str, batches: tuple[int, ...], context: int, reps: int) -> dict[int, Any]:
    """Seconds of a decode step's parts on their own at each batch (the best of ``reps``): each
    linear shape over every layer's own weights, the head, and attention over ``batch`` sequences
    of ``context`` keys in every layer's own cache."""
    import torch

    from jitney.worker.attention.backend import AttentionMetadata, InvariantCpuAttention, to_kernel_layout
    from jitney.worker.kernels.cpu.ops import InvariantLinear, Int8Linear

    make = InvariantLinear if kind == "bf16" else Int8Linear
    shapes = linear_shapes(cfg)
    layers = [{name: make(torch.empty(n, k, dtype=torch.bfloat16).normal_(0, 0.02), None)
               for name, k, n, _ in shapes[:-1]} for _ in range(cfg.num_layers)]
    _, hk, hn, _ = shapes[-1]
    head = make(torch.empty(hn, hk, dtype=torch.bfloat16).normal_(0, 0.02), None, out_float=True)
    attention = InvariantCpuAttention()
    block = 16
    out: dict[int, Any] = {}
    with torch.inference_mode():
        for batch in batches:
            xs = {k: torch.randn(batch, k).bfloat16() for _, k, _, _ in shapes}
            per: dict[str, float] = {}
            for name, k, _, _ in shapes[:-1]:
                mods = [layer[name] for layer in layers]
                per[name] = _best_seconds(lambda: [m(xs[k]) for m in mods], reps)
            per["lm_head"] = _best_seconds(lambda: head(xs[hk]), reps)
            per_seq = -(-(context + 1) // block)
            caches = [to_kernel_layout(
                torch.randn(batch * per_seq, block, cfg.num_kv_heads, cfg.head_dim).bfloat16(),
                torch.randn(batch * per_seq, block, cfg.num_kv_heads, cfg.head_dim).bfloat16())
                for _ in range(cfg.num_layers)]
            meta = attention.prepare(AttentionMetadata.build(
                query_lens=[1] * batch, seq_lens=[context + 1] * batch,
                block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)],
                block_size=block, device=torch.device("cpu")))
            query = torch.randn(batch, cfg.num_heads, cfg.head_dim).bfloat16()
            per["attention"] = _best_seconds(lambda: [attention.attend(query, kc, vc, meta, cfg.head_dim ** -0.5)
                                              for kc, vc in caches], reps)
            out[batch] = per
            del caches
    return out


def breakdown(model: Path, cfg: ModelConfig, kind: str, ns: argparse.Namespace) -> dict[str, Any]:
    """The worker's decode step at 1 and ``BATCH`` sequences, one sequence's before and after the
    idle gap, and the step's parts on their own (``part_times``); ms. ``part_floors`` adds the floors."""
    from bench.decode_step import decode_series, make_runner

    runner = make_runner("auto", model=str(model), quantization="none" if kind == "bf16" else kind)
    steps: dict[str, Any] = {}
    seq = 1
    for batch in (1, BATCH):
        series = decode_series(runner, batch, ns.context, 24, seq)
        seq += batch
        tail = series[4:]
        steps[str(batch)] = {"model_ms": _ms(statistics.median(m for m, _ in tail)),
                             "execute_ms": _ms(statistics.median(t for _, t in tail))}
    before = decode_series(runner, 1, ns.context, 32, seq)
    seq += 1
    time.sleep(ns.idle)
    after = decode_series(runner, 1, ns.context, 32, seq)
    idle = {name: {"first8_model_ms": _ms(statistics.fmean(m for m, _ in s[:8])),
                   "rest_model_ms": _ms(statistics.fmean(m for m, _ in s[8:]))}
            for name, s in (("before", before), ("after", after))}
    del runner
    gc.collect()
    parts = part_times(cfg, kind, (1, BATCH), ns.context, ns.part_reps)
    rows = {}
    for batch, per in parts.items():
        by_shape = {name: v for name, v in per.items() if name not in ("lm_head", "attention")}
        linears = sum(by_shape.values())
        model_s = steps[str(batch)]["model_ms"] / 1000
        rows[str(batch)] = {
            **steps[str(batch)],
            "linears_ms": _ms(linears), "by_shape_ms": {name: _ms(v) for name, v in by_shape.items()},
            "head_ms": _ms(per["lm_head"]), "attention_ms": _ms(per["attention"]),
            "rest_ms": _ms(model_s - linears - per["lm_head"] - per["attention"]),
            "host_ms": round(steps[str(batch)]["execute_ms"] - steps[str(batch)]["model_ms"], 2),
        }
    return {"context": ns.context, "batches": rows, "idle_in_process": idle}


def part_floors(cfg: ModelConfig, kind: str, batch: int, context: int, rate_gbs: float) -> dict[str, float]:
    """The decode step's parts' floors, ms: their bytes at ``rate_gbs`` (the layers' and the head's
    weights, ``batch`` sequences' K/V of ``context`` + 1 keys)."""
    layer_bytes, head_bytes = weight_bytes_split(cfg, kind)
    kv = kv_bytes_per_token(cfg) * batch * (context + 1)
    return {"linears_floor_ms": _ms(layer_bytes / (rate_gbs * 1e9)), "head_floor_ms": _ms(head_bytes / (rate_gbs * 1e9)),
            "attention_floor_ms": _ms(kv / (rate_gbs * 1e9))}


# ---------------------------------------------------------------- report

def render(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results["models"].items():
        lines.append(f"## {name} ({res['weights_gb']:.2f} GB bf16 weights; read rate {res['rate_gbs']:.1f} GB/s "
                     f"(passes {', '.join(f'{r:.1f}' for r in res['rate_passes'])}), bf16 peak "
                     f"{res['peak_gflops']:.0f} GFLOP/s at 512 rows)\n")
        lines.append("| kind | 16 at once, wall s (median; runs) | spread | TPOT p50 ms | one stream TPOT ms "
                     "(median) | its floor ms | x floor | after idle TPOT ms | x stream | next request ms |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for kind, k in res["kinds"].items():
            if "error" in k:
                lines.append(f"| {kind} | failed: {k['error']} |||||||||")
                continue
            s = k["serving"]
            stream = [r for r in s["streams"] if r["phase"] == "stream"]
            idle = next(r for r in s["streams"] if r["phase"] == "after-idle")
            nxt = next(r for r in s["streams"] if r["phase"] == "after-idle-next")
            lines.append(
                f"| {kind} | {s['batch16']['median_s']:.2f} ({', '.join(f'{w:.2f}' for w in s['batch16']['walls_s'])}) "
                f"| {s['batch16']['spread']:.1%} | {statistics.median(s['batch16']['tpot_p50_ms']):.1f} "
                f"| {statistics.median(r['tpot_ms'] for r in stream):.1f} "
                f"| {statistics.median(r['floor_ms'] for r in stream):.1f} | {s['stream_over_floor_median']:.2f} "
                f"| {idle['tpot_ms']:.1f} | {s['idle_tpot_ratio']:.2f} | {nxt['tpot_ms']:.1f} |")
        lines.append("\nSteps against their floors (`step_floors`: each step's FLOPs at the peak or bytes at "
                     "the read rate, whichever is larger; phases: linears, head and attention in turn):\n")
        lines.append("| kind | phase | group | steps | model s | floor s | phased floor s | x phased floor |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for kind, k in res["kinds"].items():
            for phase, sf in k.get("serving", {}).get("steps", {}).items():
                for g in sf["groups"]:
                    lines.append(f"| {kind} | {phase} | {g['group']} | {g['steps']} | {g['model_s']:.2f} "
                                 f"| {g['floor_s']:.2f} | {g['phases_s']:.2f} | {g['model_s'] / g['phases_s']:.2f} |")
        lines.append(f"\nThe decode step's parts (context {next(iter(res['kinds'].values())).get('breakdown', {}).get('context')}"
                     " keys; ms; floor = bytes at the read rate):\n")
        lines.append("| kind | seqs | model | execute | linears (floor) | head (floor) | attention (floor) | rest | host |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for kind, k in res["kinds"].items():
            for batch, r in k.get("breakdown", {}).get("batches", {}).items():
                lines.append(f"| {kind} | {batch} | {r['model_ms']:.1f} | {r['execute_ms']:.1f} "
                             f"| {r['linears_ms']:.1f} ({r['linears_floor_ms']:.1f}) | {r['head_ms']:.1f} "
                             f"({r['head_floor_ms']:.1f}) | {r['attention_ms']:.2f} ({r['attention_floor_ms']:.2f}) "
                             f"| {r['rest_ms']:.1f} | {r['host_ms']:.1f} |")
        lines.append("\nIn this process, one sequence's decode steps, before and after the idle gap "
                     "(model ms: mean of the first 8 steps, of the rest):\n")
        for kind, k in res["kinds"].items():
            idle = k.get("breakdown", {}).get("idle_in_process")
            if idle:
                lines.append(f"- {kind}: before {idle['before']['first8_model_ms']:.1f} / "
                             f"{idle['before']['rest_model_ms']:.1f}; after {idle['after']['first8_model_ms']:.1f} / "
                             f"{idle['after']['rest_model_ms']:.1f}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--repeats", type=int, default=3, help="runs of the 16-at-once batch (default 3)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens of every request (default 64)")
    ap.add_argument("--streams", type=int, default=4, help="requests one at a time (default 4)")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds idle before the after-idle request")
    ap.add_argument("--context", type=int, default=128, help="the breakdown's keys per sequence")
    ap.add_argument("--part-reps", type=int, default=5, help="calls of each part (the best counts)")
    ap.add_argument("--no-breakdown", action="store_true", help="serving only")
    ap.add_argument("--checkpoints", type=Path, default=None, help="keep (and reuse) the checkpoints here")
    ap.add_argument("--traces", type=Path, default=None, help="keep the step traces here")
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    if ns.traces:
        ns.traces.mkdir(parents=True, exist_ok=True)
    if ns.repeats < 1 or ns.streams < 2 or ns.tokens < 10 or ns.idle < 0:
        ap.error("--repeats >= 1, --streams >= 2, --tokens >= 10 and --idle >= 0")
    items = [WorkItem(i.id, 0.0, i.prompt_token_ids, ns.tokens) for i in load_workload(WORKLOAD)[:BATCH]]
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(ns).items()}, "models": {}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="jitney-real-shapes-") as tmp:
        for name in ns.models:
            where = ns.checkpoints or Path(tmp)
            path = where / name
            if not (path / "config.json").exists():
                print(f"making {name}", flush=True)
                make_model(name, path)
            cfg = model_config(str(path))
            rates = [measure_bandwidth(BANDWIDTH_MB, 5)]
            measured = measure_shapes(cfg, 512, 3)
            pk = peak(measured["shapes"], workload_flops(cfg, items)["by_shape"])
            res: dict[str, Any] = {"weights_gb": weight_bytes(cfg) / 1e9, "peak_gflops": pk["peak_gflops"],
                                   "peak_kernel": pk["peak_kernel"], "kinds": {}}
            gots: dict[str, Any] = {}
            for kind in ns.kinds:
                print(f"{name} {kind}", flush=True)
                try:
                    scratch = Path(tmp) / f"{name}-{kind}"
                    scratch.mkdir()
                    gots[kind] = serve_phases(path, kind, items, ns, scratch)
                    res["kinds"][kind] = {}
                    if not ns.no_breakdown:
                        res["kinds"][kind]["breakdown"] = breakdown(path, cfg, kind, ns)
                except Exception as err:  # noqa: BLE001 - reported, the other cases go on
                    failed = True
                    res["kinds"][kind] = {"error": f"{type(err).__name__}: {str(err)[-600:]}"}
                    print(f"  failed: {err}", flush=True)
            rates.append(measure_bandwidth(BANDWIDTH_MB, 5))
            res["rate_passes"], res["rate_gbs"] = rates, max(rates)
            for kind, got in gots.items():   # the floors at the run's best rate
                res["kinds"][kind]["serving"] = phase_report(cfg, kind, got, pk["peak_gflops"], max(rates))
                if "breakdown" in res["kinds"][kind]:   # its floors at the same rate
                    for batch, row in res["kinds"][kind]["breakdown"]["batches"].items():
                        row.update(part_floors(cfg, kind, int(batch), ns.context, max(rates)))
            results["models"][name] = res
            print(render({"models": {name: res}}), flush=True)
            if ns.json:
                ns.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
