"""Fair share between tenants: one tenant floods, another sends online traffic.

Three runs on the default model, each on a fresh `jitney serve`, side by side:

    run       server              traffic
    alone     --fairness tenant   the light tenant only: online-64's arrivals
    tenant    --fairness tenant   the flood (offline-64, every request at 0 s,
                                  tenant "flood") and the light tenant's online-64
    fcfs      --fairness off      the same two loads, boarded by arrival

Requests go through gRPC with the `tenant` field (no API keys), greedy,
ignore_eos, exactly max_tokens tokens each (checked). Reported per run and
tenant: TTFT p50 / p99, E2E p99, output tokens/s, errors; and the light
tenant's TTFT p99 against its p99 alone for each of tenant and fcfs (the
issue's target: tenant <= 2x alone).

    python bench/fairness.py [--limit N] [--runs alone tenant fcfs] [--json PATH]
    python bench/fairness.py --simulate [--seats N] [--limit N] [--sim-step-s S] [--sim-token-s S]

``--limit N`` takes the first N requests of each workload (a short run);
``--model`` another model than the default; extra server flags after ``--``.

``--simulate`` replays the same three runs through the real Scheduler and
the tests' fake worker (tests/support/fake_worker.py) on a step-time model
instead of a server (a step takes ``SIM_STEP_S`` plus ``SIM_TOKEN_S`` a
token: assumed round numbers, not measurements): the policy alone, in
simulated seconds, free of the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.client.bench import Outcome, WorkItem, load_workload, summarize  # noqa: E402
from jitney.client.channel import open_aio_channel  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402
from jitney.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from jitney.scheduler.core.config import SchedulerConfig  # noqa: E402
from jitney.scheduler.core.request import Request, SamplingOptions  # noqa: E402
from jitney.scheduler.core.scheduler import Scheduler  # noqa: E402
from tests.support.fake_worker import VOCAB, FakeWorker  # noqa: E402
from tests.support.server_harness import running_server  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"
RUNS = {  # run -> (--fairness, whether the flood runs)
    "alone": ("tenant", False),
    "tenant": ("tenant", True),
    "fcfs": ("off", True),
}
SIM_STEP_S, SIM_TOKEN_S = 0.03, 0.0004    # --simulate: seconds a step, and a token of it


def simulate(name: str, light: list[WorkItem], flood: list[WorkItem], seats: int,
             step_s: float = SIM_STEP_S, token_s: float = SIM_TOKEN_S) -> dict[str, Any]:
    """One run through the real Scheduler and the fake worker, on simulated time."""
    fairness, flooded = RUNS[name]
    config = SchedulerConfig(block_size=16, num_blocks=4096, max_model_len=4096, max_num_seqs=seats,
                             max_num_batched_tokens=512, fairness=fairness)  # type: ignore[arg-type]
    scheduler, worker = Scheduler(config), FakeWorker(config.num_blocks, config.block_size)
    loads = {"light": light, **({"flood": flood} if flooded else {})}
    arrivals = sorted(((item.arrival_s, tenant, Outcome(item)) for tenant, items in loads.items()
                       for item in items), key=lambda a: a[0])
    outcomes: dict[int, Outcome] = {}
    now, seq_id = 0.0, 0
    while arrivals or scheduler.has_work():
        while arrivals and arrivals[0][0] <= now:
            _, tenant, outcome = arrivals.pop(0)
            seq_id += 1
            item = outcome.item
            scheduler.add_request(Request(seq_id, [t % VOCAB for t in item.prompt_token_ids],
                                          SamplingOptions(max_tokens=item.max_tokens, ignore_eos=True),
                                          item.arrival_s, tenant=tenant))
            outcomes[seq_id] = outcome
        if not scheduler.has_work():
            now = arrivals[0][0]
            continue
        output = scheduler.schedule()
        result = worker.execute(_wire(output))
        now += step_s + token_s * output.num_batched_tokens
        for request in scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids),
                                                    list(result.logprobs)):
            done = outcomes[request.seq_id]
            done.token_times.extend([now] * request.last_step_tokens)
            done.num_tokens += request.last_step_tokens
    by_tenant: dict[str, list[Outcome]] = {}
    for seq, outcome in outcomes.items():
        tenant = next(t for t, items in loads.items() if outcome.item in items)
        by_tenant.setdefault(tenant, []).append(outcome)
    return {tenant: _row(group) for tenant, group in by_tenant.items()}


def _wire(output: Any) -> Any:
    from jitney.engine.v1 import engine_pb2
    from jitney.scheduler.core.plan import to_step_plan

    return engine_pb2.SchedulerMessage.FromString(
        engine_pb2.SchedulerMessage(plan=to_step_plan(output)).SerializeToString()).plan


async def _replay(target: str, loads: dict[str, list[WorkItem]]) -> dict[str, list[Outcome]]:
    """Send every tenant's items at their arrival times; each request's token times."""
    outcomes = {tenant: [Outcome(item) for item in items] for tenant, items in loads.items()}
    async with open_aio_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        t0 = time.perf_counter()

        async def one(tenant: str, outcome: Outcome) -> None:
            item = outcome.item
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
            params = pb.GenerationParams(token_ids=pb.TokenIds(ids=item.prompt_token_ids), tenant=tenant,
                                         sampling=pb.SamplingParams(max_tokens=item.max_tokens,
                                                                    temperature=0.0, ignore_eos=True))
            try:
                async for msg in stub.GenerateStream(pb.GenerateStreamRequest(params=params)):
                    outcome.token_times.extend([time.perf_counter() - t0] * len(msg.token_ids))
                    outcome.num_tokens += len(msg.token_ids)
            except Exception as exc:    # counted as an error of the run, never hidden
                outcome.error = repr(exc)

        await asyncio.gather(*(one(t, o) for t, group in outcomes.items() for o in group))
    return outcomes


def _row(outcomes: list[Outcome]) -> dict[str, Any]:
    ends = [o.token_times[-1] for o in outcomes if o.token_times]
    s = summarize(outcomes, max(ends) - min(o.item.arrival_s for o in outcomes) if ends else 0.0)
    return {"requests": s["requests"], "errors": s["errors"],
            "ttft_p50_s": round(s["ttft_s"]["p50"], 3), "ttft_p99_s": round(s["ttft_s"]["p99"], 3),
            "e2e_p99_s": round(s["e2e_s"]["p99"], 3), "output_tok_s": round(s["output_tok_s"], 2)}


def run(name: str, light: list[WorkItem], flood: list[WorkItem], model: str | None, extra: list[str],
        tmp: Path) -> dict[str, Any]:
    fairness, flooded = RUNS[name]
    args = ["--fairness", fairness, *(["--model", model] if model else []), *extra]
    loads = {"light": light, **({"flood": flood} if flooded else {})}
    with running_server(args, tmp) as server:
        outcomes = asyncio.run(_replay(server.target, loads))
        log = server.log()
    if "Traceback" in log:
        raise RuntimeError(f"{name}: the server logged a traceback:\n{log[-4000:]}")
    return {tenant: _row(group) for tenant, group in outcomes.items()}


def verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "alone" not in results:
        return out
    alone = results["alone"]["light"]["ttft_p99_s"]
    for name in ("tenant", "fcfs"):
        if name in results and alone > 0:
            out[f"light_ttft_p99_{name}_over_alone"] = round(results[name]["light"]["ttft_p99_s"] / alone, 2)
    if "light_ttft_p99_tenant_over_alone" in out:
        out["tenant_within_2x_alone"] = out["light_ttft_p99_tenant_over_alone"] <= 2.0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled default model)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--simulate", action="store_true",
                    help="the scheduler and the fake worker on a step-time model, no server")
    ap.add_argument("--seats", type=int, default=64, help="--simulate: max_num_seqs (default 64)")
    ap.add_argument("--sim-step-s", type=float, default=SIM_STEP_S, help="--simulate: seconds a step")
    ap.add_argument("--sim-token-s", type=float, default=SIM_TOKEN_S, help="--simulate: seconds a token")
    ap.add_argument("server_flags", nargs="*", help="more `jitney serve` flags (after --)")
    ns = ap.parse_args()
    light = load_workload(WORKLOADS / "online-64.jsonl")[:ns.limit]
    flood = load_workload(WORKLOADS / "offline-64.jsonl")[:ns.limit]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.runs:
            results[name] = (simulate(name, light, flood, ns.seats, ns.sim_step_s, ns.sim_token_s) if ns.simulate
                             else run(name, light, flood, ns.model, ns.server_flags, Path(tmp)))
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    report = {"runs": results, "verdict": verdict(results), "simulated": ns.simulate,
              "light_requests": len(light), "flood_requests": len(flood)}
    print(json.dumps(report, indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(report, indent=2))
    return 0 if not any(row["errors"] for r in results.values() for row in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
