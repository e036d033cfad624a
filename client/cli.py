"""The `jitney` command: serve, scheduler, worker, generate."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import cast
from pathlib import Path

import grpc

LOG_LEVELS = ["debug", "info", "warning", "error"]


def _server_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from scheduler.main import add_scheduler_arguments
    from worker.config import add_worker_arguments

    serve = sub.add_parser("serve", help="run the scheduler and one worker (the usual way)")
    add_worker_arguments(serve)
    add_scheduler_arguments(serve, with_shared=False)
    from scheduler.supervisor import add_supervisor_arguments

    add_supervisor_arguments(serve)
    sched = sub.add_parser("scheduler", help="run the scheduler process alone (gRPC + scheduling)")
    add_scheduler_arguments(sched)
    work = sub.add_parser("worker", help="run the worker process alone (model + KV cache)")
    add_worker_arguments(work)
    for p in (serve, sched, work):
        p.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def _generate_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    gen.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")


def _health_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    health = sub.add_parser("health", help="exit 0 when the server reports SERVING (for probes)")
    health.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    health.add_argument("--timeout", type=float, default=3.0)


def cmd_health(ns: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(ns.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=ns.timeout)
        except grpc.RpcError as err:
            print(f"jitney: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    bench = sub.add_parser("bench", help="replay a workload (JSONL) against a running server")
    bench.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    bench.add_argument("--workload", type=Path, required=True, help="JSONL file, one request a line")
    bench.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    bench.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")


def _plot_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    plot = sub.add_parser("plot", help="draw the seat chart of step traces (serve --trace)")
    plot.add_argument("traces", nargs="+", type=Path, help="trace files (JSONL), one column each")
    plot.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    plot.add_argument("--title", action="append", default=None,
                      help="column title (repeat once per trace; default: file names)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jitney", description="Jitney: an in-flight batching LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    _server_parsers(sub)
    _generate_parser(sub)
    _health_parser(sub)
    _bench_parser(sub)
    _plot_parser(sub)
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_generate(ns: argparse.Namespace) -> int:
    from client.client import FINISH_REASON_NAMES, JitneyClient, Sampling, make_params

    sampling = Sampling(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed,
                        max_tokens=ns.max_tokens, stop=ns.stop, ignore_eos=ns.ignore_eos)
    params = make_params(ns.prompt, chat=ns.chat, sampling=sampling)
    text, ids, last = [], [], None
    with JitneyClient(ns.target) as client:
        try:
            for msg in client.generate_stream(params, timeout=ns.timeout):
                text.append(msg.text)
                ids.extend(msg.token_ids)
                last = msg
                if not ns.json:
                    print(msg.text, end="", flush=True)
        except grpc.RpcError as err:
            print(f"\njitney: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if ns.json:
        assert last is not None
        print(json.dumps({
            "text": "".join(text),
            "token_ids": ids,
            "finish_reason": FINISH_REASON_NAMES.get(last.finish_reason, "unspecified"),
            "usage": {"prompt_tokens": last.usage.prompt_tokens,
                      "completion_tokens": last.usage.completion_tokens,
                      "cached_prompt_tokens": last.usage.cached_prompt_tokens},
        }))
    else:
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "generate":
        return cmd_generate(ns)
    if ns.command == "health":
        return cmd_health(ns)
    if ns.command == "plot":
        from client.plot import plot

        if ns.title is not None and len(ns.title) != len(ns.traces):
            parser.error("give --title once per trace, or not at all")
        plot(ns.traces, ns.output, ns.title)
        return 0
    if ns.command == "bench":
        from client.bench import run_bench

        return run_bench(ns.target, ns.workload, ns.json, ns.max_concurrency, not ns.no_progress)
    if ns.command in ("serve", "scheduler") and ns.max_num_batched_tokens < ns.max_num_seqs:
        parser.error(f"--max-num-batched-tokens ({ns.max_num_batched_tokens}) must be at least "
                     f"--max-num-seqs ({ns.max_num_seqs}): every seat must be able to decode in one step")
    _configure_logging(ns.log_level)
    if ns.command == "scheduler":
        from scheduler.main import SchedulerProcessConfig, run_scheduler

        return run_scheduler(SchedulerProcessConfig.from_namespace(ns))
    if ns.command == "worker":
        from worker.config import WorkerConfig
        from worker.main import run_worker

        return run_worker(WorkerConfig.from_namespace(ns))
    from scheduler.supervisor import child_argv, supervise

    sub = cast("dict[str, argparse.ArgumentParser]",
               parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    return supervise(child_argv(sub["scheduler"], ns), child_argv(sub["worker"], ns),
                     max_worker_restarts=ns.max_worker_restarts, drain_seconds=ns.drain_seconds)


if __name__ == "__main__":
    sys.exit(main())
