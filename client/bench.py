"""`jitney bench`: replay a workload file against a running server.

Each line of the workload is ``{"id", "arrival_s", "prompt_token_ids",
"max_tokens"}``. Every request is sent over GenerateStream at its
``arrival_s`` (relative to the start), greedy, with ``ignore_eos``, so every
system does the same work. A request that does not receive exactly
``max_tokens`` tokens, or ends with an error, is counted as an error and makes
the exit status non-zero.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from jitney.client.channel import TlsFiles, open_aio_channel
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class WorkItem:
    id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    lora_adapter: str = ""   # a LoRA adapter's served name (GenerationParams.lora_adapter); "": the base model


@dataclass
class Outcome:
    item: WorkItem
    token_times: list[float] = field(default_factory=list)   # seconds since bench start, one per token
    num_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.num_tokens == self.item.max_tokens


def load_workload(path: Path) -> list[WorkItem]:
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            adapter = row.get("lora_adapter", "")
            if not isinstance(adapter, str):
                raise TypeError(f"lora_adapter must be a string, got {adapter!r}")
            items.append(WorkItem(str(row["id"]), float(row["arrival_s"]),
                                  [int(t) for t in row["prompt_token_ids"]], int(row["max_tokens"]), adapter))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: not a workload line: {exc}") from None
    return sorted(items, key=lambda i: i.arrival_s)


async def _run_one(stub: pb_grpc.GenerationServiceStub, item: WorkItem, t0: float,
                   limit: asyncio.Semaphore, progress: Any) -> Outcome:
    outcome = Outcome(item)
    await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
    async with limit:
        params = pb.GenerationParams(token_ids=pb.TokenIds(ids=item.prompt_token_ids),
                                     sampling=pb.SamplingParams(max_tokens=item.max_tokens, temperature=0.0,
                                                                ignore_eos=True),
                                     lora_adapter=item.lora_adapter)
        try:
            async for msg in stub.GenerateStream(pb.GenerateStreamRequest(params=params)):
                now = time.perf_counter() - t0
                outcome.token_times.extend([now] * len(msg.token_ids))
                outcome.num_tokens += len(msg.token_ids)
        except grpc.aio.AioRpcError as err:
            outcome.error = f"{err.code().name}: {err.details()}"
    if outcome.error is None and outcome.num_tokens != item.max_tokens:
        outcome.error = f"received {outcome.num_tokens} tokens, expected {item.max_tokens}"
    progress.update(1)
    return outcome


async def replay(target: str, items: list[WorkItem], max_concurrency: int | None,
                 show_progress: bool = True, *, tls: TlsFiles | None = None,
                 api_key: str | None = None) -> tuple[list[Outcome], float]:
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency or len(items) or 1)
    async with open_aio_channel(target, tls=tls, api_key=api_key) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # fail fast if not serving
        with tqdm(total=len(items), desc="requests", unit="req", disable=not show_progress,
                  file=sys.stderr) as progress:
            t0 = time.perf_counter()
            outcomes = await asyncio.gather(*[_run_one(stub, i, t0, limit, progress) for i in items])
            wall = time.perf_counter() - t0
    return list(outcomes), wall


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def pct(p: float) -> float:  # nearest-rank percentile: the ceil(p% * n)-th value
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.token_times]
    prompt_tokens = sum(len(o.item.prompt_token_ids) for o in outcomes)
    output_tokens = sum(o.num_tokens for o in outcomes)
    tpots = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1)
             for o in done if len(o.token_times) > 1]
    return {
        "requests": len(outcomes),
        "errors": sum(not o.ok for o in outcomes),
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / wall if wall > 0 else 0.0,
        "total_tok_s": (prompt_tokens + output_tokens) / wall if wall > 0 else 0.0,
        "ttft_s": _dist([o.token_times[0] - o.item.arrival_s for o in done]),
        "tpot_s": _dist(tpots),
        "e2e_s": _dist([o.token_times[-1] - o.item.arrival_s for o in done]),
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"requests      {summary['requests']}   errors {summary['errors']}",
        f"wall          {summary['wall_s']:.2f} s",
        f"tokens        {summary['prompt_tokens']} prompt, {summary['output_tokens']} output",
        f"throughput    {summary['output_tok_s']:.1f} output tok/s, {summary['total_tok_s']:.1f} total tok/s",
        f"{'':14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"), ("e2e_s", "E2E (s)")):
        d = summary[key]
        lines.append(f"{label:14}" + "".join(f"{d[k]:>10.3f}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def run_bench(target: str, workload: Path, json_out: Path | None, max_concurrency: int | None,
              show_progress: bool = True, *, tls: TlsFiles | None = None, api_key: str | None = None) -> int:
    items = load_workload(workload)
    outcomes, wall = asyncio.run(replay(target, items, max_concurrency, show_progress,
                                        tls=tls, api_key=api_key))
    summary = summarize(outcomes, wall)
    print(format_table(summary))
    for o in outcomes:
        if not o.ok:
            print(f"error: request {o.item.id}: {o.error}", file=sys.stderr)
    if json_out is not None:
        json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["errors"] else 0
