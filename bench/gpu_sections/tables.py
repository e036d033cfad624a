"""The report's number formats and its tables of the offline, decode and prefill sections."""

from __future__ import annotations

from typing import Any

from bench.gpu_sections.plumbing import Run


def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def fmt_s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}"


def fmt_ratio(on: float | None, off: float | None) -> str:
    return f"{on / off:.3f}" if on is not None and off else "n/a"


def _offline_row(shape: str, case: dict[str, Any], hf_wall: float | None) -> str:
    first = " / ".join(f"{d * 1e3:.0f}" for d in case["first_steps_s"]) or "n/a"
    ratio = f"{hf_wall / case['wall_s']:.1f}x" if hf_wall and case["wall_s"] > 0 else "n/a"
    return (f"| {shape} | {case['case']} | {case['wall_s']:.2f} | {case['output_tok_s']:.0f} | "
            f"{case['ttft_s']['p50']:.3f} | {case['steps']} | {case['max_step_s'] * 1e3:.1f} | {first} | "
            f"{case['steps_over_50ms']} | {case['startup_s']:.1f} | {case['completed']}/{case['requests']} | "
            f"{ratio} |")


def offline_table(run: Run) -> list[str]:
    lines = ["## offline-64 (`jitney serve` + `jitney bench`)", "",
             "Wall from the first request to the last token; steps from the server's `--trace` (every step "
             "after Ready, `dur` as the scheduler sees it). \"vs HF CB\": transformers' continuous batching "
             "wall / this wall (higher is better).", "",
             "| shape | case | wall s | output tok/s | TTFT p50 s | steps | longest step ms | first two steps ms "
             "| steps > 50 ms | start-up s | completed | vs HF CB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, data in run.shapes.items():
        hf = data.get("hf")
        hf_wall = hf["wall_s"] if hf else None
        lines += [_offline_row(shape, case, hf_wall) for case in data.get("offline", [])]
        if hf:
            lines.append(f"| {shape} | {hf['case']} (warm-up {hf['warmup_s']:.1f} s not timed) | "
                         f"{hf['wall_s']:.2f} | {hf['output_tok_s']:.0f} | | | | | | | "
                         f"{hf['completed']}/{hf['requests']} | 1.0x |")
    return lines


def startup_section(run: Run) -> list[str]:
    lines = ["## Server start-up lines", ""]
    for shape, data in run.shapes.items():
        for case in data.get("offline", []):
            lines += [f"{shape}, {case['case']} (SERVING after {case['startup_s']:.1f} s):", "", "```",
                      *(case["startup_lines"] or ["(none found in the log)"]), "```", ""]
    return lines


def decode_table(run: Run) -> list[str]:
    lines = ["## Decode step (worker `ModelRunner.execute()`)", "",
             "Wall time around `execute()` of one decode step of B sequences (each with "
             f"{run.args.context}+ tokens of context), median and best of the reps after 3 warm-ups; "
             "\"graph\": one replay of the captured decode graph alone (CUDA events).", "",
             "| shape | batch | execute() median ms | execute() best ms | graph ms |", "|---|---|---|---|---|"]
    for shape, data in run.shapes.items():
        for row in data.get("decode", []):
            graph = fmt_ms(row["graph_s"]) if row["graph_s"] is not None else f"n/a ({row['graph_note']})"
            lines.append(f"| {shape} | {row['batch']} | {fmt_ms(row['execute_s_median'])} | "
                         f"{fmt_ms(row['execute_s_min'])} | {graph} |")
    return lines


def prefill_table(run: Run) -> list[str]:
    lines = ["## Prefill step (worker `ModelRunner.execute()`)", "",
             "One step of a single chunk of N prompt tokens (a fresh sequence each time): the first (cold), "
             "then, after one more warm-up, median and best of the reps. \"step\": a captured mixed-step graph "
             "(steps up to 512 tokens) or eager; up to 512 tokens both run, on the same runner.", "",
             "| shape | tokens | step | execute() median ms | execute() best ms | first ms |",
             "|---|---|---|---|---|---|"]
    for shape, data in run.shapes.items():
        for row in data.get("prefill", []):
            lines.append(f"| {shape} | {row['tokens']} | {row.get('mode', 'eager')} | {fmt_ms(row['execute_s_median'])} | "
                         f"{fmt_ms(row['execute_s_min'])} | {fmt_ms(row['first_s'])} |")
    return lines
