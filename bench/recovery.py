"""Start-up and recovery times of `jitney serve` on the default model.

    python bench/recovery.py [--kills 6] [--clients 4] [--json FILE]

1. **Cold start**: an empty weights cache (a fresh ``JITNEY_WEIGHTS_CACHE``):
   process start to health SERVING; the worker converts the GGUF file and
   writes the cache.
2. **Warm start**: the same again with the cache filled.
3. **Restarts**: on the warm server, with ``--clients`` threads streaming
   greedy requests, SIGKILL the worker ``--kills`` times. Each restart is
   timed from the kill to health SERVING with a new worker pid
   (restart-to-SERVING), and to the first request that completes on the new
   worker (a client's view). Between kills the load runs ``--between`` s.

Prints one table and, with ``--json``, writes the numbers. Health is polled
every 20 ms over one channel, so times are good to ~20 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import running_server  # noqa: E402
from jitney.client.client import Sampling, make_params  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402
from jitney.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING
POLL = 0.02


def _serving(health: health_pb2_grpc.HealthStub) -> bool:
    try:
        return health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == SERVING
    except grpc.RpcError:
        return False


def timed_start(args: list[str], log_dir: Path) -> tuple[float, str]:
    """Seconds from `jitney serve` started to SERVING, and the worker's load line."""
    started = time.monotonic()
    with running_server(args, log_dir, wait_serving=False, standby=True) as server:
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not _serving(health):
                if server.proc.poll() is not None:
                    raise RuntimeError(server.log())
                if time.monotonic() - started > 300:
                    raise TimeoutError(server.log())
                time.sleep(POLL)
        took = time.monotonic() - started
        loaded = [line for line in server.log().splitlines() if "loaded " in line and "from" in line]
        return took, loaded[-1].split("jitney.worker INFO ")[-1] if loaded else ""


def restarts(args: list[str], log_dir: Path, kills: int, clients: int, between: float,
             standby: bool = True) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    with running_server(args, log_dir, standby=standby) as server:
        channel = grpc.insecure_channel(server.target)
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.GenerationServiceStub(channel)
        stop = threading.Event()
        completions: list[tuple[float, int]] = []   # (time, worker pid at the time) of finished requests
        lock = threading.Lock()

        def client(i: int) -> None:
            params = make_params(f"Tell me a story about the number {i}.", chat=True,
                                 sampling=Sampling(max_tokens=24, ignore_eos=True))
            while not stop.is_set():
                try:
                    for msg in stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=60):
                        if msg.finish_reason:
                            with lock:
                                completions.append((time.monotonic(), 0))
                except grpc.RpcError:
                    time.sleep(0.02)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        try:
            for _ in range(kills):
                time.sleep(between)
                pid = server.stats().worker_pid
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                while True:
                    if _serving(health):
                        try:
                            now_pid = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=1).worker_pid
                        except grpc.RpcError:
                            now_pid = 0
                        if now_pid not in (0, pid):
                            break
                    if time.monotonic() - killed > 120:
                        raise TimeoutError(server.log())
                    time.sleep(POLL)
                serving = time.monotonic() - killed
                while not any(t > killed + serving - POLL for t, _ in completions):
                    if time.monotonic() - killed > 120:
                        raise TimeoutError("no request completed after the restart")
                    time.sleep(POLL)
                first = min(t for t, _ in completions if t > killed + serving - POLL) - killed
                out.append({"serving_s": serving, "first_completion_s": first})
                print(f"  kill {len(out)}: SERVING after {serving:.2f} s, first completion after {first:.2f} s",
                      flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=70)
            channel.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--between", type=float, default=4.0, help="seconds of load before each kill")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--also-without-standby", action="store_true",
                        help="repeat the kills with --no-standby-worker (a fresh process each time)")
    parser.add_argument("server_args", nargs="*", help="more `jitney serve` flags (after --)")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jitney-recovery-") as tmp:
        os.environ["JITNEY_WEIGHTS_CACHE"] = str(Path(tmp) / "weights")   # empty: a cold start
        args = list(ns.server_args)
        cold, cold_line = timed_start(args, Path(tmp))
        print(f"cold start: {cold:.2f} s to SERVING ({cold_line})", flush=True)
        warm, warm_line = timed_start(args, Path(tmp))
        print(f"warm start: {warm:.2f} s to SERVING ({warm_line})", flush=True)
        runs = restarts(args, Path(tmp), ns.kills, ns.clients, ns.between)
        fresh = []
        if ns.also_without_standby:
            print("without the standby worker:", flush=True)
            fresh = restarts(args, Path(tmp), ns.kills, ns.clients, ns.between, standby=False)
    serving = [r["serving_s"] for r in runs]
    first = [r["first_completion_s"] for r in runs]
    summary: dict[str, Any] = {
        "cold_start_s": cold, "warm_start_s": warm, "kills": len(runs),
        "restart_to_serving_s": {"p50": statistics.median(serving), "max": max(serving), "all": serving},
        "restart_to_first_completion_s": {"p50": statistics.median(first), "max": max(first), "all": first},
    }
    print(f"\n| measure | p50 | max |\n|---|---|---|\n"
          f"| cold start to SERVING | {cold:.2f} s | |\n| warm start to SERVING | {warm:.2f} s | |\n"
          f"| kill to SERVING ({len(runs)} kills) | {summary['restart_to_serving_s']['p50']:.2f} s | "
          f"{max(serving):.2f} s |\n"
          f"| kill to first completed request | {summary['restart_to_first_completion_s']['p50']:.2f} s | "
          f"{max(first):.2f} s |")
    if fresh:
        fresh_serving = [r["serving_s"] for r in fresh]
        fresh_first = [r["first_completion_s"] for r in fresh]
        summary["without_standby"] = {
            "restart_to_serving_s": {"p50": statistics.median(fresh_serving), "max": max(fresh_serving),
                                     "all": fresh_serving},
            "restart_to_first_completion_s": {"p50": statistics.median(fresh_first), "max": max(fresh_first),
                                              "all": fresh_first}}
        print(f"| kill to SERVING, no standby ({len(fresh)} kills) | {statistics.median(fresh_serving):.2f} s | "
              f"{max(fresh_serving):.2f} s |\n"
              f"| kill to first completed request, no standby | {statistics.median(fresh_first):.2f} s | "
              f"{max(fresh_first):.2f} s |")
    if ns.json:
        ns.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
