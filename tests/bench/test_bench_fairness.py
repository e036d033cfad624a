"""bench/fairness.py's --simulate: the real scheduler and the fake worker on a
step-time model (simulated seconds, deterministic), and its verdict."""

from __future__ import annotations

from bench.fairness import WORKLOADS, simulate, verdict
from jitney.client.bench import load_workload


def test_simulated_runs_do_all_the_work_and_the_flood_does_not_delay_the_light_tenant_as_fcfs_does() -> None:
    light = load_workload(WORKLOADS / "online-64.jsonl")[:16]
    flood = load_workload(WORKLOADS / "offline-64.jsonl")[:16]
    results = {name: simulate(name, light, flood, seats=8) for name in ("alone", "tenant", "fcfs")}
    assert set(results["alone"]) == {"light"} and set(results["tenant"]) == {"light", "flood"}
    assert all(row["errors"] == 0 and row["requests"] == 16 for run in results.values() for row in run.values())
    light_p99 = {name: results[name]["light"]["ttft_p99_s"] for name in results}
    assert light_p99["alone"] < light_p99["tenant"] < light_p99["fcfs"]
    out = verdict(results)
    assert out["light_ttft_p99_tenant_over_alone"] < out["light_ttft_p99_fcfs_over_alone"]
