"""The client side of the `jitney` command: generate, health, bench.

Imports only the public API (``jitney.v1`` through ``jitney.client``);
``jitney.cli`` adds these subcommands next to the server's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc


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


def cmd_generate(ns: argparse.Namespace) -> int:
    from jitney.client.client import FINISH_REASON_NAMES, JitneyClient, Sampling, make_params

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


def run(ns: argparse.Namespace) -> int:
    """Run the client subcommand ``ns.command`` (generate, health or bench)."""
    if ns.command == "generate":
        return cmd_generate(ns)
    if ns.command == "health":
        return cmd_health(ns)
    from jitney.client.bench import run_bench

    return run_bench(ns.target, ns.workload, ns.json, ns.max_concurrency, not ns.no_progress)


def add_client_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The generate, health and bench subcommands."""
    _generate_parser(sub)
    _health_parser(sub)
    _bench_parser(sub)


CLIENT_COMMANDS = ("generate", "health", "bench")
