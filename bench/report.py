"""Render docs/benchmarks.md from one run of bench/run_benchmarks.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEADER = """# Benchmarks

Written by `bench/run_benchmarks.py` from one run: every case below ran side
by side on the same machine in the same session, so ratios between them are
meaningful; absolute figures move with the machine's load. Workloads are the
files of `bench/workloads/` as they are; every request is greedy with
`ignore_eos` and must receive exactly `max_tokens` tokens (errors would be
counted). Default model: SmolLM2-135M-Instruct (bundled GGUF), default flags
unless listed (`--dtype auto`: bf16 on this CPU).

Reproduce: `.venv/bin/python bench/run_benchmarks.py` (all cases, ~15 min), or
`--only continuous static-8` for some. One case by hand:

    jitney serve --trace /tmp/t.jsonl &          # flags of the case
    jitney bench --workload bench/workloads/offline-64.jsonl --json /tmp/r.json

The GPU figures (`bench/gpu.py`, on an H100/H200) are in [benchmarks-gpu.md](benchmarks-gpu.md).

Machine: {machine}.
"""


def overhead(trace_path: str) -> dict[str, float]:
    """Non-model share of step time, from a step trace.

    A step's period is the gap between its result and the one before (with
    overlap, steps follow each other on the worker); model_s is the model's
    own time in it (forward + logits); the rest is the non-model cost:
    input preparation, sampling, plan/result transport, scheduling and
    detokenisation as far as they are not hidden by the overlap.
    """
    rows = [json.loads(line) for line in Path(trace_path).read_text().splitlines() if line]
    done = [r["t"] + r["dur"] for r in rows]
    wall = done[-1] if rows else 0.0
    out = {"steps": len(rows), "wall_s": wall,
           "worker_busy": sum(r["worker_s"] for r in rows) / wall if wall else 0.0}
    for label, keep in (("batch_ge_16", lambda r: len(r["seats"]) >= 16),
                        ("batch_lt_16", lambda r: len(r["seats"]) < 16)):
        sel = [(done[i] - done[i - 1], rows[i]["model_s"], rows[i]["worker_s"])
               for i in range(1, len(rows)) if keep(rows[i])]
        period = sum(p for p, _, _ in sel)
        out[f"{label}_steps"] = len(sel)
        out[f"{label}_non_model"] = 1 - sum(m for _, m, _ in sel) / period if period else 0.0
        out[f"{label}_worker_non_model"] = sum(w - m for _, m, w in sel) / period if period else 0.0
    return out


def _overhead_section(results: dict[str, Any]) -> list[str]:
    cont = results.get("continuous")
    if not cont or "trace" not in cont or not Path(cont["trace"]).exists():
        return []
    o = overhead(cont["trace"])
    return ["", "## Non-model cost of a step (continuous, offline-64, from its step trace)", "",
            f"{o['steps']} steps; the worker was busy {o['worker_busy']:.1%} of the wall time "
            "(step N+1 is planned while step N runs, so it never waits for a plan).", "",
            "| steps | count | non-model share of step time | of which in the worker (inputs, sampling) |",
            "|---|---|---|---|",
            f"| batch ≥ 16 | {o['batch_ge_16_steps']} | {o['batch_ge_16_non_model']:.1%} | "
            f"{o['batch_ge_16_worker_non_model']:.1%} |",
            f"| batch < 16 | {o['batch_lt_16_steps']} | {o['batch_lt_16_non_model']:.1%} | "
            f"{o['batch_lt_16_worker_non_model']:.1%} |"]


def _row(name: str, r: dict[str, Any]) -> str:
    ttft = r.get("ttft_s", {}).get("p50")
    tpot = r.get("tpot_s", {}).get("p50")
    fmt = lambda v, scale=1.0, d=2: "–" if v is None else f"{v * scale:.{d}f}"  # noqa: E731
    flags = " ".join(r.get("flags", [])) or ("transformers generate" if "flags" not in r else "(defaults)")
    return (f"| {name} | `{flags}` | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
            f"{fmt(ttft)} | {fmt(tpot, 1000, 1)} | {r.get('errors', 0)} |")


def _table(results: dict[str, Any], names: list[str]) -> list[str]:
    lines = ["| case | flags | wall s | output tok/s | total tok/s | TTFT p50 s | TPOT p50 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    return lines + [_row(n, results[n]) for n in names if n in results]


def _ratio(results: dict[str, Any], a: str, b: str) -> float | None:
    if a in results and b in results:
        return results[a]["output_tok_s"] / results[b]["output_tok_s"]
    return None


def _target(ok: bool | None, text: str) -> str:
    mark = "–" if ok is None else ("met" if ok else "**missed**")
    return f"| {text} | {mark} |"


def render(results: dict[str, Any], machine: str) -> str:
    out = [HEADER.format(machine=machine)]
    out += ["## offline-64 (64 requests at t = 0)", ""]
    out += _table(results, ["continuous", "continuous-8", "static-8", "sequential", "hf-generate"])
    out += ["", "| ratio of output tok/s | value | target |", "|---|---|---|"]
    for a, b, goal in (("continuous", "static-8", 3), ("continuous", "sequential", 6),
                       ("continuous", "hf-generate", 4), ("continuous-8", "static-8", None)):
        r = _ratio(results, a, b)
        out.append(f"| {a} / {b} | {'–' if r is None else f'{r:.2f}×'} | {'' if goal is None else f'≥ {goal}×'} |")
    out += _overhead_section(results)
    out += ["", "## 32 concurrent streams of 128 tokens (greedy, default model)", ""]
    out += _table(results, ["streams-32x128"])
    out += ["", "## online-64 (Poisson arrivals, 1 request/s)", ""]
    out += _table(results, ["online"])
    out += ["", "## prefix-64 (64 requests sharing a 384-token prefix)", ""]
    out += _table(results, ["prefix-cache", "no-prefix-cache"])
    if "prefix-cache" in results and "no-prefix-cache" in results:
        on, off = results["prefix-cache"], results["no-prefix-cache"]
        out += ["", "| | prefix cache on | off | change |", "|---|---|---|---|",
                f"| prompt tokens computed | {on['computed_prompt_tokens']} | {off['computed_prompt_tokens']} | "
                f"{1 - on['computed_prompt_tokens'] / off['computed_prompt_tokens']:.1%} fewer |",
                f"| TTFT p50 s | {on['ttft_s']['p50']:.2f} | {off['ttft_s']['p50']:.2f} | "
                f"{off['ttft_s']['p50'] / on['ttft_s']['p50']:.2f}× lower |",
                f"| output tok/s | {on['output_tok_s']:.1f} | {off['output_tok_s']:.1f} | "
                f"{on['output_tok_s'] / off['output_tok_s']:.2f}× |"]
    out += ["", "## Targets", "", "| target | result |", "|---|---|"]
    cont, online = results.get("continuous"), results.get("online")
    for a, b, goal in (("continuous", "static-8", 3), ("continuous", "sequential", 6), ("continuous", "hf-generate", 4)):
        r = _ratio(results, a, b)
        out.append(_target(None if r is None else r >= goal, f"{a} ≥ {goal}× {b} output tok/s"))
    out.append(_target(None if cont is None else cont["wall_s"] <= 22, "offline-64 wall ≤ 22 s"))
    out.append(_target(None if online is None else online["ttft_s"]["p99"] <= 0.5,
                       f"online-64 TTFT p99 ≤ 0.5 s (got {online['ttft_s']['p99']:.2f})" if online else "online-64 TTFT p99 ≤ 0.5 s"))
    out.append(_target(None if online is None else online["tpot_s"]["p50"] <= 0.030,
                       f"online-64 TPOT p50 ≤ 30 ms (got {online['tpot_s']['p50'] * 1000:.1f})" if online else "online-64 TPOT p50 ≤ 30 ms"))
    out += ["", "Analysis of what limits each figure: [performance.md](performance.md).", ""]
    return "\n".join(out)
