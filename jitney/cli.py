"""The `jitney` command: one entry point that dispatches to the parts.

``serve``, ``scheduler`` and ``worker`` run ``jitney.scheduler`` and
``jitney.worker``; ``generate``, ``health`` and ``bench`` are
``jitney.client``'s; ``plot`` draws step traces (``jitney.scheduler.plot``);
``keys`` writes the link's Curve keys (``jitney.common.zmq_security``);
``router`` routes across replicas (``jitney.scheduler.router.main``).
The client's small command module is imported at start; the scheduler and
the worker only inside the function that runs them, so the client library
never pulls in the server's code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import cast

from jitney.client.cli import CLIENT_COMMANDS, add_client_parsers, run as run_client_command

LOG_LEVELS = ["debug", "info", "warning", "error"]


def _server_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from jitney.scheduler.main import add_scheduler_arguments
    from jitney.worker.config import add_worker_arguments

    serve = sub.add_parser("serve", help="run the scheduler and one worker (the usual way)")
    add_worker_arguments(serve)
    add_scheduler_arguments(serve, with_shared=False)
    from jitney.scheduler.launch.supervisor import add_supervisor_arguments

    add_supervisor_arguments(serve)
    from jitney.worker.config import add_dist_timeout_argument

    add_dist_timeout_argument(serve)   # passed to the ranks of --tensor-parallel-size
    sched = sub.add_parser("scheduler", help="run the scheduler process alone (gRPC + scheduling)")
    add_scheduler_arguments(sched)
    work = sub.add_parser("worker", help="run the worker process alone (model + KV cache)")
    add_worker_arguments(work)
    from jitney.worker.config import add_parallel_arguments

    add_parallel_arguments(work)
    for p in (serve, sched, work):
        p.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def _router_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from jitney.scheduler.router.main import add_router_arguments

    router = sub.add_parser("router", help="route requests across several Jitney servers (cache-aware)")
    add_router_arguments(router)
    router.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def _plot_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    plot = sub.add_parser("plot", help="draw the seat chart of step traces (serve --trace)")
    plot.add_argument("traces", nargs="+", type=Path, help="trace files (JSONL), one column each")
    plot.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    plot.add_argument("--title", action="append", default=None,
                      help="column title (repeat once per trace; default: file names)")


def _keys_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    keys = sub.add_parser("keys", help="generate CurveZMQ keys for the scheduler<->worker link")
    keys.add_argument("--out", type=Path, required=True, metavar="DIR",
                      help="folder to write server.key, server.key_secret, worker.key, worker.key_secret "
                           "to (created mode 0700; secret files 0600)")
    keys.add_argument("--split", action="store_true",
                      help="write the scheduler's files to DIR/scheduler and the worker's to DIR/worker, "
                           "so that neither side holds the other's secret")
    keys.add_argument("--if-missing", action="store_true",
                      help="keep a complete existing set and exit 0 (default: existing keys are an error)")


def _run_keys(ns: argparse.Namespace) -> int:
    from jitney.common.zmq_security import LinkSecurityError, generate_keys

    try:
        written = generate_keys(ns.out, split=ns.split, if_missing=ns.if_missing)
    except (LinkSecurityError, OSError) as exc:
        print(f"jitney keys: {exc}", file=sys.stderr)
        return 1
    if not written:
        print(f"jitney keys: a complete set already exists in {ns.out}; kept it")
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jitney", description="Jitney: an in-flight batching LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    _server_parsers(sub)
    _router_parser(sub)
    add_client_parsers(sub)
    _plot_parser(sub)
    _keys_parser(sub)
    return parser


def _security_problem(ns: argparse.Namespace) -> str | None:
    """Why the TLS / API-key flags cannot be used (files read and checked), before
    any process starts; None when they can."""
    from jitney.scheduler.security.tls import SecurityError, load_security, security_fields

    try:
        load_security(**security_fields(ns))
    except SecurityError as exc:
        return str(exc)
    return None


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command in CLIENT_COMMANDS:
        return run_client_command(ns)
    if ns.command == "plot":
        from jitney.scheduler.plot import plot

        if ns.title is not None and len(ns.title) != len(ns.traces):
            parser.error("give --title once per trace, or not at all")
        plot(ns.traces, ns.output, ns.title)
        return 0
    if ns.command == "keys":
        return _run_keys(ns)
    if ns.command == "router":
        from jitney.scheduler.router.main import RouterConfig, run_router

        _configure_logging(ns.log_level)
        return run_router(RouterConfig.from_namespace(ns))
    if (ns.command in ("serve", "scheduler") and None not in (ns.max_num_batched_tokens, ns.max_num_seqs)
            and ns.max_num_batched_tokens < ns.max_num_seqs):
        parser.error(f"--max-num-batched-tokens ({ns.max_num_batched_tokens}) must be at least "
                     f"--max-num-seqs ({ns.max_num_seqs}): every seat must be able to decode in one step")
    if (ns.command in ("serve", "scheduler") and ns.max_num_batched_tokens is not None
            and ns.speculative != "off" and ns.num_speculative_tokens >= ns.max_num_batched_tokens):
        parser.error(f"--num-speculative-tokens ({ns.num_speculative_tokens}) must be below "
                     f"--max-num-batched-tokens ({ns.max_num_batched_tokens})")
    if ns.command == "serve" and (ns.speculative == "draft") != (ns.draft_model is not None):
        parser.error("--speculative draft and --draft-model PATH go together (the draft model proposes, "
                     "the scheduler verifies)")
    if ns.command in ("serve", "scheduler") and (problem := _security_problem(ns)):
        print(f"jitney {ns.command}: {problem}", file=sys.stderr, flush=True)
        return 2
    _configure_logging(ns.log_level)
    from jitney.common.zmq_security import LinkSecurityError

    try:
        return _run_server_command(parser, ns)
    except LinkSecurityError as exc:     # unsafe or unusable link keys / endpoints: no start
        print(f"jitney {ns.command}: {exc}", file=sys.stderr, flush=True)
        return 2


def _run_server_command(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    if ns.command == "scheduler":
        from jitney.scheduler.main import SchedulerProcessConfig, run_scheduler

        return run_scheduler(SchedulerProcessConfig.from_namespace(ns))
    if ns.command == "worker":
        from jitney.worker.config import WorkerConfig
        from jitney.worker.main import run_worker

        return run_worker(WorkerConfig.from_namespace(ns))
    from jitney.common.zmq_security import load_client_keys, load_server_keys
    from jitney.scheduler.launch.supervisor import child_argv, supervise, tensor_parallel_problem

    if ns.curve_keys:      # both children read this folder: check it before either starts
        load_server_keys(ns.curve_keys)
        load_client_keys(ns.curve_keys)
    sub = cast("dict[str, argparse.ArgumentParser]",
               parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    tp_size = ns.tensor_parallel_size
    if tp_size > 1 and ns.standby_worker:
        print("jitney serve: --standby-worker is not available with --tensor-parallel-size > 1",
              file=sys.stderr, flush=True)
        return 2
    if problem := tensor_parallel_problem(ns.model, tp_size):
        print(f"jitney serve: {problem}", file=sys.stderr, flush=True)
        return 2
    standby = ns.standby_worker if ns.standby_worker is not None else ns.device == "cpu" and tp_size == 1
    return supervise(child_argv(sub["scheduler"], ns), child_argv(sub["worker"], ns),
                     max_worker_restarts=ns.max_worker_restarts, drain_seconds=ns.drain_seconds,
                     standby=standby, tp_size=tp_size)


if __name__ == "__main__":
    sys.exit(main())
