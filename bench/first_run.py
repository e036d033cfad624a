#!/usr/bin/env python3
"""The first minute after Ready: offline-64 right after start against the same again.

    .venv/bin/python bench/first_run.py [--repeat 2] [--replays 2] [--json FILE]

Cases, each a fresh `jitney serve` on the default model, replaying
bench/workloads/offline-64.jsonl `--replays` times back to back, the first
as soon as the server is SERVING:

    standby-off    --no-standby-worker --no-prefix-cache
    standby-on     --no-prefix-cache (the default standby worker, which loads
                   during the first minute)
    cache-on       --no-standby-worker, the prefix cache on (the default): a
                   replay after the first reads every prompt from the cache,
                   so it is not a warm run of the same work

The prefix cache is off in the first two so that every replay computes the
same tokens: what a later replay then saves is what the first paid for
being first. Cases run in turns (A B C A B C ...) so that the machine's drift
falls on all of them. The table gives each replay's wall, the later replays
over the first, and the first replay's wall with the standby over without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.server_harness import running_server  # noqa: E402
from jitney.client.bench import load_workload, replay, summarize  # noqa: E402

WORKLOAD = ROOT / "bench" / "workloads" / "offline-64.jsonl"
CASES: dict[str, tuple[list[str], bool]] = {     # flags, standby
    "standby-off": (["--no-prefix-cache"], False),
    "standby-on": (["--no-prefix-cache"], True),
    "cache-on": ([], False),
}


def run_case(name: str, replays: int, workdir: Path) -> list[float]:
    """One fresh server, ``replays`` replays from the moment it is SERVING: their walls."""
    flags, standby = CASES[name]
    items = load_workload(WORKLOAD)
    walls = []
    with running_server(flags, workdir, startup_timeout=300, standby=standby) as server:
        for _ in range(replays):
            outcomes, wall = asyncio.run(replay(server.target, items, None, False))
            summary = summarize(outcomes, wall)
            if summary["errors"]:
                raise RuntimeError(f"{name}: {summary['errors']} requests failed")
            walls.append(wall)
        note = _standby_loaded(server.log, time.monotonic()) if standby else ""
    print(f"{name:12} " + "  ".join(f"{w:6.2f} s" for w in walls) + note, flush=True)
    return walls


def _standby_loaded(log: Callable[[], str], since: float, timeout: float = 60.0) -> str:
    """Once the replays are over the server is quiet: when its standby came up."""
    while time.monotonic() - since < timeout:
        if "standby: loaded and warm" in log():
            return f"   (standby up {time.monotonic() - since:.1f} s after the last replay)"
        time.sleep(0.2)
    return f"   (no standby {timeout:g} s after the last replay)"


def report(runs: dict[str, list[list[float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": {}}
    for name, walls in runs.items():
        firsts = [w[0] for w in walls]
        later = [statistics.median(w[1:]) for w in walls if len(w) > 1]
        out["cases"][name] = {
            "walls_s": walls,
            "first_median_s": statistics.median(firsts),
            "later_median_s": statistics.median(later) if later else None,
            "first_over_later": statistics.median(f / l for f, l in zip(firsts, later)) if later else None,
        }
    on, off = out["cases"].get("standby-on"), out["cases"].get("standby-off")
    if on and off:
        out["standby_first_over_no_standby_first"] = on["first_median_s"] / off["first_median_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2, help="turns over the cases")
    ap.add_argument("--replays", type=int, default=2, help="replays per server (the first right after Ready)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    runs: dict[str, list[list[float]]] = {name: [] for name in ns.cases}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(ns.repeat):
            for name in ns.cases:
                runs[name].append(run_case(name, ns.replays, Path(tmp)))
    result = report(runs)
    print()
    print(f"{'case':12} {'first':>8} {'later':>8} {'first/later':>12}")
    for name, c in result["cases"].items():
        later = f"{c['later_median_s']:8.2f}" if c["later_median_s"] is not None else f"{'-':>8}"
        ratio = f"{c['first_over_later']:12.3f}" if c["first_over_later"] is not None else f"{'-':>12}"
        print(f"{name:12} {c['first_median_s']:8.2f} {later} {ratio}")
    if "standby_first_over_no_standby_first" in result:
        print(f"first replay, standby on / off: {result['standby_first_over_no_standby_first']:.3f}")
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
