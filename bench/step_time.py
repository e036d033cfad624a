"""`--max-step-ms` on the default model: off against a few targets, side by side.

Each (workload, setting) runs on a fresh `jitney serve` (same flags otherwise,
a step trace on), replaying the workload with `jitney bench`'s client
(greedy, ignore_eos, exactly max_tokens tokens each). With ``--repeats N``
the settings run in turns (off, 40, 60, ..., off, 40, ...), so a slow spell
of a shared machine falls on every setting alike.

    workload        arrivals              what the target should move (issue 42)
    offline-64      all at 0 s            TPOT p99 <= 100 ms, wall <= 1.05 x off
    online-64       Poisson, 1 a second   TTFT p99 <= 1.10 x off

Reported per run: wall; TPOT (a request's mean time per output token after
its first) p50 / p99; the gap between consecutive tokens of a stream
(inter-token latency) p50 / p99 / max: the stall a streaming user sees;
TTFT p50 / p99; and from the trace: steps, steps with decodes, the model
time of those steps (p50 / p99 / max) and how many exceeded the target, and
the step-cost model's error: |predicted_s - model_s| / model_s over the
steps it predicted (median, p90), and the mean signed error (bias).

    python bench/step_time.py [--workloads offline-64 online-64] [--values 0 40 60 80 100]
                              [--limit N] [--repeats N] [--model PATH] [--json PATH]
                              [--traces DIR]

``--values``: the settings, 0 = off. ``--limit N`` replays only the first N
requests of each workload (a short check; numbers from it are noise).
``--traces DIR`` keeps each run's step trace there (`jitney plot` draws them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.client.bench import load_workload, summarize  # noqa: E402
from jitney.scheduler.core.trace import read_trace  # noqa: E402
from tests.support.server_harness import replay_on_fresh_server  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"
NAMES = ("offline-64", "online-64")
DEFAULT_VALUES = (0.0, 40.0, 60.0, 80.0, 100.0)


def _pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (as `jitney bench`); nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


def step_stats(trace: list[dict[str, Any]], target_ms: float) -> dict[str, Any]:
    """Steps with decodes (their model time, how many over the target) and
    the cost model's error on every step it predicted."""
    with_decodes = [s for s in trace if s["decode_tokens"]]
    model = [s["model_s"] for s in with_decodes]
    predicted = [s for s in trace if s.get("predicted_s") is not None and s["model_s"] > 0]
    errors = [abs(s["predicted_s"] - s["model_s"]) / s["model_s"] for s in predicted]
    signed = [(s["predicted_s"] - s["model_s"]) / s["model_s"] for s in predicted]
    out: dict[str, Any] = {
        "steps": len(trace), "steps_with_decodes": len(with_decodes),
        "decode_step_model_ms": {"p50": _ms(_pct(model, 50)), "p99": _ms(_pct(model, 99)),
                                 "max": _ms(max(model, default=float("nan")))},
        "predicted_steps": len(predicted),
        "prediction_error": {"median": round(_pct(errors, 50), 3), "p90": round(_pct(errors, 90), 3),
                             "mean_signed": round(statistics.fmean(signed), 3) if signed else float("nan")},
    }
    if target_ms:
        out["decode_steps_over_target"] = sum(m > target_ms / 1000 for m in model)
    return out


def run_one(name: str, target_ms: float, model: str | None, limit: int | None, tmp: Path, turn: int) -> dict[str, Any]:
    items = load_workload(WORKLOADS / f"{name}.jsonl")[:limit]
    trace = tmp / f"{name}-{target_ms:g}-{turn}.jsonl"
    args = ["--max-step-ms", f"{target_ms:g}", "--trace", str(trace)] + (["--model", model] if model else [])
    outcomes, wall = replay_on_fresh_server(args, items, tmp, f"{name} --max-step-ms {target_ms:g}")
    summary = summarize(outcomes, wall)
    gaps = [b - a for o in outcomes for a, b in zip(o.token_times, o.token_times[1:])]
    return {
        "wall_s": round(wall, 3), "errors": summary["errors"],
        "tpot_ms": {"p50": _ms(summary["tpot_s"]["p50"]), "p99": _ms(summary["tpot_s"]["p99"])},
        "itl_ms": {"p50": _ms(_pct(gaps, 50)), "p99": _ms(_pct(gaps, 99)), "max": _ms(max(gaps, default=float("nan")))},
        "ttft_ms": {"p50": _ms(summary["ttft_s"]["p50"]), "p99": _ms(summary["ttft_s"]["p99"])},
        **step_stats(read_trace(trace), target_ms),
    }


def _table(name: str, runs: dict[str, list[dict[str, Any]]]) -> str:
    head = (f"{name:<11}{'wall s':>8}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>9}{'ITL max':>9}"
            f"{'TTFT p99':>10}{'step p99':>10}{'>target':>8}{'err med':>8}{'err p90':>8}")
    lines = [head]
    for setting, reps in runs.items():
        for r in reps:
            lines.append(f"{setting:<11}{r['wall_s']:>8.2f}{r['tpot_ms']['p50']:>10.1f}{r['tpot_ms']['p99']:>10.1f}"
                         f"{r['itl_ms']['p99']:>9.1f}{r['itl_ms']['max']:>9.1f}{r['ttft_ms']['p99']:>10.1f}"
                         f"{r['decode_step_model_ms']['p99']:>10.1f}{r.get('decode_steps_over_target', '-')!s:>8}"
                         f"{r['prediction_error']['median']:>8.3f}{r['prediction_error']['p90']:>8.3f}")
    return "\n".join(lines)


def targets(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """The issue's targets per setting, against off's median (where off ran)."""
    verdict: dict[str, Any] = {}
    median = lambda reps, f: statistics.median(f(r) for r in reps)   # noqa: E731
    off_offline, off_online = runs.get("offline-64", {}).get("off"), runs.get("online-64", {}).get("off")
    for setting in next(iter(runs.values()), {}):
        if setting == "off":
            continue
        v: dict[str, Any] = {}
        if off_offline and setting in runs["offline-64"]:
            reps = runs["offline-64"][setting]
            v["offline_tpot_p99_ms"] = median(reps, lambda r: r["tpot_ms"]["p99"])
            v["offline_tpot_p99_le_100ms"] = v["offline_tpot_p99_ms"] <= 100
            v["offline_wall_ratio"] = round(median(reps, lambda r: r["wall_s"]) / median(off_offline, lambda r: r["wall_s"]), 3)
            v["offline_wall_le_1.05"] = v["offline_wall_ratio"] <= 1.05
        if off_online and setting in runs.get("online-64", {}):
            reps = runs["online-64"][setting]
            v["online_ttft_p99_ratio"] = round(median(reps, lambda r: r["ttft_ms"]["p99"])
                                               / median(off_online, lambda r: r["ttft_ms"]["p99"]), 3)
            v["online_ttft_p99_le_1.10"] = v["online_ttft_p99_ratio"] <= 1.10
        verdict[setting] = v
    return verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", choices=NAMES, default=list(NAMES))
    ap.add_argument("--values", nargs="+", type=float, default=list(DEFAULT_VALUES), metavar="MS",
                    help="--max-step-ms settings to compare, 0 = off (default: 0 40 60 80 100)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each setting, in turns (default 1)")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled default model)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--traces", type=Path, default=None, metavar="DIR", help="keep the step traces here")
    ns = ap.parse_args()
    if any(v < 0 or not math.isfinite(v) for v in ns.values) or ns.repeats < 1:
        ap.error("--values must be finite numbers >= 0 and --repeats at least 1")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = ns.traces or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for name in ns.workloads:
            runs[name] = {}
            for turn in range(ns.repeats):
                for value in ns.values:
                    setting = "off" if value == 0 else f"{value:g} ms"
                    result = run_one(name, value, ns.model, ns.limit, where, turn)
                    runs[name].setdefault(setting, []).append(result)
                    print(f"{name} {setting} (turn {turn + 1}): wall {result['wall_s']} s, TPOT p99 "
                          f"{result['tpot_ms']['p99']} ms, TTFT p99 {result['ttft_ms']['p99']} ms", file=sys.stderr)
    report = {"runs": runs, "targets": targets(runs)}
    for name, by_setting in runs.items():
        print(_table(name, by_setting) + "\n")
    print(json.dumps(report["targets"], indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if not any(r["errors"] for w in runs.values() for reps in w.values() for r in reps) else 1


if __name__ == "__main__":
    sys.exit(main())
