#!/usr/bin/env python3
"""What TLS and an API key cost: offline-64 against `jitney serve` plaintext
and `jitney serve --tls-cert ... --api-key-file ...`, side by side.

    .venv/bin/python bench/tls_cost.py [--rounds N] [--limit K] [--model PATH] [-- SERVER FLAGS]

One server at a time, alternating (plaintext, secured, plaintext, ...), the
same model and flags; each round starts a fresh server and replays the
workload with `jitney bench` (greedy, ignore_eos, exactly max_tokens), the
secured one with ``--tls-ca`` and the key in ``JITNEY_API_KEY``. The
certificates (tests/support/certs.py) and the key are made for the run in a
temporary folder. Prints each run's throughput, the medians, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "bench" / "workloads" / "offline-64.jsonl"
sys.path.insert(0, str(ROOT))

from tests.support.certs import make_pki  # noqa: E402
from tests.support.server_harness import running_server  # noqa: E402
from jitney.client.channel import API_KEY_ENV, TlsFiles  # noqa: E402


def run_case(name: str, workload: Path, flags: list[str], folder: Path, secured: bool) -> dict[str, Any]:
    """One server, one replay of ``workload``: `jitney bench`'s summary. Secured:
    TLS with ``folder``'s certificates and its key file."""
    env, server_flags, client_flags = dict(os.environ), list(flags), []
    tls = key = None
    if secured:
        pki, key_file = folder / "pki", folder / "keys.txt"
        server_flags += ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                         "--api-key-file", str(key_file)]
        client_flags = ["--tls-ca", str(pki / "ca.pem")]
        tls, key = TlsFiles(pki / "ca.pem"), key_file.read_text().split(":", 1)[1].strip()
        env[API_KEY_ENV] = key
    out = folder / f"{name}.json"
    with running_server(server_flags, folder, startup_timeout=600, tls=tls, api_key=key) as server:
        print(f"== {name}: jitney serve {' '.join(server_flags)}", flush=True)
        code = subprocess.run([sys.executable, "-m", "jitney.cli", "bench", "--target", server.target,
                               "--workload", str(workload), "--json", str(out), "--no-progress",
                               *client_flags], cwd=ROOT, env=env).returncode
    summary: dict[str, Any] = json.loads(out.read_text())
    summary["exit_code"] = code
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternating (default 2)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first K requests")
    parser.add_argument("--model", default=None, help="--model of both servers (default: the bundled one)")
    parser.add_argument("server_flags", nargs="*", help="more flags for both servers (after --)")
    args = parser.parse_args()
    flags = (["--model", args.model] if args.model else []) + args.server_flags
    with tempfile.TemporaryDirectory(prefix="jitney-tls-cost-") as tmp:
        folder = Path(tmp)
        workload = WORKLOAD
        if args.limit is not None:
            workload = folder / "workload.jsonl"
            workload.write_text("".join(WORKLOAD.read_text().splitlines(keepends=True)[:args.limit]))
        (folder / "keys.txt").write_text(f"bench:{secrets.token_urlsafe(32)}\n")
        make_pki(folder / "pki")
        results: dict[str, list[dict[str, Any]]] = {"plaintext": [], "tls+key": []}
        for round_ in range(args.rounds):
            for case in results:
                summary = run_case(f"{case}-{round_}", workload, flags, folder, case == "tls+key")
                results[case].append(summary)
                print(f"   {summary['output_tok_s']:.1f} output tok/s, {summary['errors']} errors", flush=True)
    return report(results)


def report(results: dict[str, list[dict[str, Any]]]) -> int:
    print(f"\n{'case':12}{'runs (output tok/s)':>36}{'median':>10}{'TTFT p50':>10}")
    medians = {}
    for case, runs in results.items():
        rates = [r["output_tok_s"] for r in runs]
        medians[case] = statistics.median(rates)
        ttft = statistics.median(r["ttft_s"]["p50"] for r in runs)
        print(f"{case:12}{', '.join(f'{x:.1f}' for x in rates):>36}{medians[case]:>10.1f}{ttft:>10.3f}")
    ratio = medians["tls+key"] / medians["plaintext"] if medians["plaintext"] else float("nan")
    print(f"tls+key / plaintext throughput: {ratio:.3f}")
    failed = any(r["errors"] or r["exit_code"] for runs in results.values() for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
