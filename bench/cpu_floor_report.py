"""bench/cpu_floor.py's targets (issue 15's, from the run's own numbers) and its markdown report."""

from __future__ import annotations

from typing import Any

from bench.report import _table


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
