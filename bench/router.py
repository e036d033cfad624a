"""`jitney router` against one replica: prefix-cache hit rate and TTFT.

    python bench/router.py [--workload bench/workloads/prefix-64.jsonl] [--groups 16]
                           [--threads 1] [--out FILE.md]

For each workload, three set-ups in one run, each on freshly started
replicas (cold caches) of the default model, `--threads` torch threads each:

    single        one replica, called directly
    cache-aware   two replicas behind `jitney router --policy cache-aware`
    round-robin   two replicas behind `jitney router --policy round-robin`

Each replays the workload with `jitney bench`'s client (every request
greedy, ignore_eos, exactly max_tokens) and reads the replicas' own
prefix-cache counters: hit rate = hit tokens / queried tokens, summed.

Workloads: the file given, and (unless ``--groups 0``) a generated one with
``--groups`` distinct 384-token prefixes, four requests each, shuffled:
prefix-64 shares one prefix by all requests, so any policy computes it once
per replica; with many prefixes, where a request goes decides whether its
prefix is computed again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpc_health.v1 import health_pb2  # noqa: E402

from tests.support.server_harness import Server, health_status, running_server  # noqa: E402
from jitney.client.bench import WorkItem, load_workload, replay, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETUPS = ("single", "cache-aware", "round-robin")


def grouped_workload(groups: int, per_group: int = 4, prefix_len: int = 384, seed: int = 0) -> list[WorkItem]:
    """``groups`` prefixes of ``prefix_len`` tokens, ``per_group`` requests each,
    in a seeded random order, all arriving at 0; bodies and outputs drawn like
    bench/workloads/generate.py's prefix-64 (medians 64 and 32). (Not interleaved in
    turn: with an even number of groups, round-robin over two replicas would
    then send every group to one replica by accident.)"""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 49000) for _ in range(prefix_len)] for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    items = []
    for i, group in enumerate(order):
        body = [rng.randrange(100, 49000) for _ in range(int(min(256, max(8, rng.lognormvariate(4.16, 0.8)))))]
        out = int(min(128, max(4, rng.lognormvariate(3.47, 0.9))))
        items.append(WorkItem(f"g{i:04d}", 0.0, prefixes[group] + body, out))
    return items


def _wait_all(servers: list[Server], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for s in servers:
        while health_status(s.target, 1.0) != health_pb2.HealthCheckResponse.SERVING:
            if s.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{s.target} did not start:\n{s.log()}")
            time.sleep(0.3)


def run_setup(setup: str, items: list[WorkItem], threads: int, logs: Path) -> dict[str, Any]:
    """Start the set-up's processes, replay ``items``, read the counters."""
    n = 1 if setup == "single" else 2
    args = ["--threads", str(threads)]
    with ExitStack() as stack:
        replicas = [stack.enter_context(running_server(args, logs, wait_serving=False)) for _ in range(n)]
        _wait_all(replicas)
        target = replicas[0].target
        if setup != "single":
            router_args = [a for r in replicas for a in ("--replica", r.target)]
            router = stack.enter_context(running_server(
                [*router_args, "--policy", setup, "--no-tokenizer", "--health-interval", "0.5"], logs,
                command="router"))
            while not all(r.serving for r in router.stats().replicas):
                time.sleep(0.1)
            target = router.target
        outcomes, wall = asyncio.run(replay(target, items, None, show_progress=False))
        summary = summarize(outcomes, wall)
        stats = [r.stats() for r in replicas]
    queried = sum(s.prefix_cache_queried_tokens for s in stats)
    hit = sum(s.prefix_cache_hit_tokens for s in stats)
    return {"setup": setup, "replicas": n, "hit_rate": hit / queried if queried else 0.0,
            "hit_tokens": hit, "queried_tokens": queried,
            "per_replica_queried": [s.prefix_cache_queried_tokens for s in stats],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
            "wall_s": wall, "errors": summary["errors"]}


def table(name: str, rows: list[dict[str, Any]]) -> str:
    single = next(r for r in rows if r["setup"] == "single")
    lines = [f"### {name}", "",
             "| set-up | replicas | prefix-cache hit rate | of single's | hit / queried tokens | "
             "queried per replica | TTFT p50 | TTFT p90 | wall | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = r["hit_rate"] / single["hit_rate"] if single["hit_rate"] else float("nan")
        lines.append(f"| {r['setup']} | {r['replicas']} | {r['hit_rate']:.1%} | {share:.0%} | "
                     f"{r['hit_tokens']:,} / {r['queried_tokens']:,} | "
                     f"{' + '.join(f'{q:,}' for q in r['per_replica_queried'])} | "
                     f"{r['ttft_p50_s']:.2f} s | {r['ttft_p90_s']:.2f} s | {r['wall_s']:.1f} s | {r['errors']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Path, default=ROOT / "bench" / "workloads" / "prefix-64.jsonl")
    p.add_argument("--groups", type=int, default=16, help="prefixes of the generated workload (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    p.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    ns = p.parse_args()
    workloads = [(ns.workload.name, load_workload(ns.workload))]
    if ns.groups:
        workloads.append((f"generated: {ns.groups} prefixes x 4 requests", grouped_workload(ns.groups)))
    sections, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="jitney-router-bench-") as tmp:
        for name, items in workloads:
            rows = []
            for setup in SETUPS:
                rows.append(run_setup(setup, items, ns.threads, Path(tmp)))
                print(f"{name} / {setup}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
            raw[name] = rows
            sections.append(table(name, rows))
    text = "\n\n".join(sections) + "\n"
    print(text)
    if ns.out:
        ns.out.write_text(text)
    if ns.json:
        ns.json.write_text(json.dumps(raw, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
