#!/usr/bin/env python3
"""What batch invariance costs on offline-64, side by side in one run.

    .venv/bin/python bench/invariance_cost.py [--baseline-python PY] [--repeat 2] [--json FILE]

Cases, each a fresh `jitney serve` replaying bench/workloads/offline-64.jsonl
with `jitney bench` (greedy, ignore_eos, exactly max_tokens per request):

    invariant   this checkout, default flags (batch-invariant kernels on the CPU)
    oneDNN      this checkout, --no-batch-invariant (oneDNN matmuls, gather + SDPA attention)
    baseline    `PY -m jitney.cli serve`: another build, e.g. the commit before
                (bench/baseline_env.sh REV makes one), only with --baseline-python

The cases run in turns (A B C A B C ...) so that the machine's drift falls on
all of them; the table gives every run, the median per case and the ratios of
the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.server_harness import running_server  # noqa: E402

WORKLOAD = ROOT / "bench" / "workloads" / "offline-64.jsonl"


def run_case(python: str, flags: list[str], workload: Path, workdir: Path, tag: str) -> dict[str, Any]:
    """One server, one replay of ``workload``: the bench summary."""
    with running_server(flags, workdir, startup_timeout=300, python=python) as server:
        out = workdir / f"{tag}.json"
        cmd = [sys.executable, "-m", "jitney.cli", "bench", "--target", server.target, "--workload",
               str(workload), "--json", str(out), "--no-progress"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-python", help="interpreter of the build to compare against")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases: dict[str, tuple[str, list[str]]] = {
        "invariant": (sys.executable, []),
        "oneDNN": (sys.executable, ["--no-batch-invariant"]),
    }
    if args.baseline_python:
        cases["baseline"] = (args.baseline_python, [])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.repeat):
            for name, (python, flags) in cases.items():
                summary = run_case(python, flags, args.workload, Path(tmp), f"{name}-{turn}")
                if summary.get("errors"):
                    raise SystemExit(f"{name}: {summary['errors']} requests failed")
                runs[name].append(summary)
                print(f"{name:10s} turn {turn}: wall {summary['wall_s']:.2f} s, "
                      f"{summary['output_tok_s']:.1f} output tok/s", flush=True)
    medians = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    print("\n| case | flags | wall s (each run) | median wall s |\n|---|---|---|---|")
    for name, (_, flags) in cases.items():
        each = ", ".join(f"{r['wall_s']:.2f}" for r in runs[name])
        print(f"| {name} | `{' '.join(flags) or '(defaults)'}` | {each} | {medians[name]:.2f} |")
    print()
    for other in medians:
        if other != "invariant":
            print(f"invariant / {other} wall time: {medians['invariant'] / medians[other]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median_wall_s": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
