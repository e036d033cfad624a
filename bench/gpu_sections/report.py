"""bench/gpu.py's markdown report: the invariance section's tables and verdict, and the whole report."""

from __future__ import annotations

from typing import Any

from bench.gpu_sections.invariance import (INVARIANCE_RULE, INVARIANCE_SEED, INVARIANCE_TEMPERATURE,
                                           INVARIANCE_TOP_P, offline_median, step_median)
from bench.gpu_sections.plumbing import Run, dtype_name, is_cuda
from bench.gpu_sections.tables import (decode_table, fmt_ms, fmt_ratio, fmt_s, offline_table, on_off, prefill_table,
                                       startup_section)


def invariance_verdict(shape: str, data: dict[str, Any], run: Run) -> str:
    """One line: the offline-64 cost against the rule, and whether "on" held on this device."""
    ratio = data.get("offline_wall_ratio")
    on_rows = [r for r in data.get("rows", []) if r["batch_invariant"]]
    differ = sum(r["logprobs_differ"] for r in on_rows)
    held = (f"with it on, {differ} of {sum(r['requests'] for r in on_rows)} batched requests differ from "
            "their alone run" if on_rows else "its experiment did not run")
    if ratio is None:
        return f"{shape}: no offline-64 pair measured; {held}."
    cost = f"offline-64 wall on / off = {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)"
    if not is_cuda(run.args):
        return f"{shape}: {cost}; {held} (a CPU run: not the CUDA default's measurement)."
    within = ratio <= INVARIANCE_RULE
    rule = (f"within the {(INVARIANCE_RULE - 1) * 100:.0f}% rule" if within
            else f"over the {(INVARIANCE_RULE - 1) * 100:.0f}% rule")
    then = ("the rule says: default it on for CUDA" if within and differ == 0
            else "not invariant on this card yet: fix that before defaulting it on" if differ
            else "the CUDA default stays off")
    return f"{shape}: {cost}, {rule}; {held}: {then}."


def invariance_report(run: Run) -> list[str]:
    shapes = {shape: data["invariance"] for shape, data in run.shapes.items() if "invariance" in data}
    if not shapes:
        return []
    a = run.args
    lines = ["## Batch invariance (`--batch-invariant` off and on)", "",
             f"Worker `ModelRunner`s ({dtype_name(a)}), one per setting, driven by `tests/support/invariance_driver.py`: "
             f"{a.invariance_prompts} prompts (token ids, lengths spread from 1 to {a.invariance_longest}; the "
             f"even ones share a prefix), each greedy and seeded (T {INVARIANCE_TEMPERATURE}, top_p "
             f"{INVARIANCE_TOP_P}, seed {INVARIANCE_SEED} + prompt), {a.invariance_tokens} tokens, run alone: "
             f"the reference. Then {a.invariance_requests} requests cycling over those (shuffled), arriving in "
             "waves of 1, 2, 4, ... every 2 steps, continuous batching at each step budget (chunked prefill, "
             "prefix-cache hits, two preemptions). \"differ\": requests whose token ids / log-probs are not "
             "bit-identical to the alone run; max |dlogprob| over the tokens before the first other token id.", "",
             "| shape | batch-invariant | budget | requests | token ids differ | logprobs differ | max \\|dlogprob\\| "
             "| cached prompt tokens | preemptions | steps | largest step seqs | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, data in shapes.items():
        for r in data.get("rows", []):
            lines.append(f"| {shape} | {on_off(r['batch_invariant'])} | {r['budget']} | {r['requests']} | "
                         f"{r['tokens_differ']} | {r['logprobs_differ']} | {r['max_logprob_delta']:.3g} | "
                         f"{r['cached_prompt_tokens']} | {r['preemptions']} | {r['steps']} | "
                         f"{r['largest_step_seqs']} | {r['seconds']:.1f} |")
        for flag in (False, True):
            rows = [r for r in data.get("rows", []) if r["batch_invariant"] == flag]
            if rows:
                lines.append(f"| {shape} | {on_off(flag)} | all | {sum(r['requests'] for r in rows)} | "
                             f"{sum(r['tokens_differ'] for r in rows)} | {sum(r['logprobs_differ'] for r in rows)} "
                             "| | | | | | |")
    examples = [f"{shape}, {on_off(r['batch_invariant'])}, budget {r['budget']}: {e}"
                for shape, data in shapes.items() for r in data.get("rows", []) for e in r["examples"][:1]]
    if examples:
        lines += ["", "First differences (one per row):", "", *[f"- {e}" for e in examples]]
    lines += ["", "### What it costs", "",
              "Step rows: `execute()` median ms (the median over the rounds, off and on alternating, of each "
              "round's median), on the same runners; offline-64: `jitney serve --no-batch-invariant` / "
              "`--batch-invariant` replaying it, alternating, median wall s (each run in the table below).", "",
              "| shape | measure | off | on | on / off |", "|---|---|---|---|---|"]
    for shape, data in shapes.items():
        steps = data.get("steps", [])
        for what in dict.fromkeys(r["what"] for r in steps):
            off, on = step_median(steps, what, False), step_median(steps, what, True)
            lines.append(f"| {shape} | {what}, ms | {fmt_ms(off)} | {fmt_ms(on)} | {fmt_ratio(on, off)} |")
        cases = data.get("offline", [])
        if cases:
            off, on = offline_median(cases, False), offline_median(cases, True)
            lines.append(f"| {shape} | offline-64 wall (median), s | "
                         f"{'n/a' if off is None else f'{off:.3f}'} | {'n/a' if on is None else f'{on:.3f}'} | "
                         f"{fmt_ratio(on, off)} |")
        init = {info["batch_invariant"]: info["init_s"] for info in data.get("runners", [])}
        if init:
            lines.append(f"| {shape} | runner start-up (load, warm-up, compiles), s | {fmt_s(init.get(False))} | "
                         f"{fmt_s(init.get(True))} | {fmt_ratio(init.get(True), init.get(False))} |")
    lines += ["", "| shape | case | flags | wall s | output tok/s | TTFT p50 s | steps | start-up s | completed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for shape, data in shapes.items():
        for c in data.get("offline", []):
            lines.append(f"| {shape} | {c['case']} | `{' '.join(c['flags'])}` | {c['wall_s']:.3f} | "
                         f"{c['output_tok_s']:.0f} | {c['ttft_s']['p50']:.3f} | {c['steps']} | {c['startup_s']:.1f} | "
                         f"{c['completed']}/{c['requests']} |")
    lines += ["", *[f"- {invariance_verdict(shape, data, run)}" for shape, data in shapes.items()]]
    return lines


def render(run: Run) -> str:
    meta = run.meta
    head = [f"# Jitney GPU benchmark: {meta['card']}", "",
            f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
            f"Python {meta['python']}; {meta['dtype']} random weights; "
            f"`bench/gpu.py {' '.join(meta['argv'])}` in {meta['elapsed_s']:.0f} s "
            f"(budget {meta['budget_s']:.0f} s).", ""]
    tail = ["## Skipped", "", *([f"- {s}" for s in run.skipped] or ["- nothing"]), ""]
    if run.errors:
        tail += ["## Errors", "", *[f"- {e}" for e in run.errors], ""]
    if run.notes:
        tail += ["## Notes", "", *[f"- {n}" for n in run.notes], ""]
    invariance = invariance_report(run)
    body = [*offline_table(run), "", *decode_table(run), "", *prefill_table(run), "",
            *([*invariance, ""] if invariance else []), *startup_section(run)]
    return "\n".join(head + body + tail) + "\n"
