"""Long prompts on the default model: CPU attention forms side by side.

Issue 42's long-prompt workload: N prompts of P tokens (ids drawn once from a
fixed seed in the default model's id range, 100-48,999, as the shipped
workloads), all arriving at 0 s, each generating M tokens (greedy,
``ignore_eos``: exactly M each). Each ``--cpu-attention`` form runs on a
fresh `jitney serve` (step trace on), in turns with ``--repeats``, so a slow
spell of a shared machine falls on every form alike.

Reported per run: wall, TTFT p50 / p99, TPOT p50 / p99, and from the trace the
prefill rate (prompt tokens / model seconds) of the steps whose tokens attend
on average fewer than 512 keys (a prompt's first chunk: the short-context
rate) and of those attending 2,500 keys or more (its last chunks), and their
ratio: the issue's "prefill tok/s at 3,000 keys >= 0.7x its short-context rate".
Every step of this workload carries at most N decodes beside its chunk.
``--workload FILE`` replays a workload file instead (offline-64: what the
forms cost where prompts are short).

    python bench/long_prompts.py [--forms avx512bf16 avx512 avx2 portable] [-n 8] [--prompt 3000] [--out 64]
                                 [--workload FILE] [--repeats N] [--extra "--max-step-ms 80"]
                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.client.bench import WorkItem, load_workload, summarize  # noqa: E402
from jitney.scheduler.core.trace import read_trace  # noqa: E402
from jitney.worker.config import CPU_ATTENTION_CHOICES  # noqa: E402
from tests.support.attention_cases import named_forms, register_forms  # noqa: E402
from tests.support.server_harness import replay_on_fresh_server  # noqa: E402

SHORT_KEYS, LONG_KEYS = 512, 2500


def workload(n: int, prompt: int, out: int, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    return [WorkItem(f"long-{i}", 0.0, [rng.randrange(100, 49_000) for _ in range(prompt)], out) for i in range(n)]


def prefill_rates(trace: list[dict[str, Any]]) -> dict[str, float]:
    """Prompt tokens a model second over the short- and the long-context steps."""
    bands: dict[str, list[tuple[int, float]]] = {"short": [], "long": []}
    for s in trace:
        tokens = s["prefill_tokens"] + s["decode_tokens"]
        if not s["prefill_tokens"] or s["model_s"] <= 0:
            continue
        keys = s["attended_keys"] / tokens
        band = "short" if keys < SHORT_KEYS else "long" if keys >= LONG_KEYS else None
        if band:
            bands[band].append((s["prefill_tokens"], s["model_s"]))
    rate = {k: sum(t for t, _ in v) / sum(m for _, m in v) if v else math.nan for k, v in bands.items()}
    return {"short_tok_s": round(rate["short"], 1), "long_tok_s": round(rate["long"], 1),
            "long_over_short": round(rate["long"] / rate["short"], 3),
            "short_steps": len(bands["short"]), "long_steps": len(bands["long"])}


def run_one(form: str, items: list[WorkItem], extra: list[str], tmp: Path, turn: int) -> dict[str, Any]:
    trace = tmp / f"long-{form}-{turn}.jsonl"
    args = ["--cpu-attention", form, "--trace", str(trace), *extra]
    outcomes, wall = replay_on_fresh_server(args, items, tmp, f"--cpu-attention {form}")
    summary = summarize(outcomes, wall)
    ms = lambda d, p: round(1000 * d[p], 1)   # noqa: E731
    return {"wall_s": round(wall, 3), "errors": summary["errors"],
            "ttft_ms": {"p50": ms(summary["ttft_s"], "p50"), "p99": ms(summary["ttft_s"], "p99")},
            "tpot_ms": {"p50": ms(summary["tpot_s"], "p50"), "p99": ms(summary["tpot_s"], "p99")},
            **prefill_rates(read_trace(trace))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", nargs="+", default=None, choices=CPU_ATTENTION_CHOICES,
                    help="--cpu-attention values, in turns (default: every named form this CPU has, "
                         "then avx512, or avx2 without it)")
    ap.add_argument("-n", type=int, default=8, help="prompts (default 8)")
    ap.add_argument("--prompt", type=int, default=3000, help="tokens a prompt (default 3000)")
    ap.add_argument("--out", type=int, default=64, help="tokens each generates (default 64)")
    ap.add_argument("--workload", type=Path, default=None, help="replay this workload file instead")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--extra", default="", help="more `jitney serve` flags, one string")
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    ns.forms = ns.forms or [*named_forms(), *(register_forms() or ["portable"])[:1]]
    if min(ns.n, ns.prompt, ns.out, ns.repeats) < 1:
        ap.error("-n, --prompt, --out and --repeats must be at least 1")
    items = load_workload(ns.workload) if ns.workload else workload(ns.n, ns.prompt, ns.out)
    runs: dict[str, list[dict[str, Any]]] = {form: [] for form in ns.forms}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(ns.repeats):
            for form in ns.forms:
                r = run_one(form, items, shlex.split(ns.extra), Path(tmp), turn)
                runs[form].append(r)
                print(f"{form} (turn {turn + 1}): {r}", file=sys.stderr)
    print(f"{ns.workload.name if ns.workload else f'{ns.n} x {ns.prompt}-token prompts, {ns.out} tokens each'}\n")
    print("| --cpu-attention | wall s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | prefill tok/s, < 512 keys "
          "| at >= 2,500 keys | ratio |\n|---|---|---|---|---|---|---|")
    for form, reps in runs.items():
        for r in reps:
            print(f"| {form} | {r['wall_s']:.2f} | {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} "
                  f"| {r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | {r['short_tok_s']:.0f} "
                  f"| {r['long_tok_s']:.0f} | {r['long_over_short']:.2f} |")
    if len(ns.forms) > 1:
        base = statistics.median(r["wall_s"] for r in runs[ns.forms[-1]])
        for form in ns.forms[:-1]:
            ratio = statistics.median(r["wall_s"] for r in runs[form]) / base
            print(f"\nwall, {form} / {ns.forms[-1]} (medians): {ratio:.3f}")
    if ns.json:
        ns.json.write_text(json.dumps(runs, indent=2) + "\n")
    return 0 if not any(r["errors"] for reps in runs.values() for r in reps) else 1


if __name__ == "__main__":
    sys.exit(main())
