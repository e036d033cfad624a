"""Start real Jitney processes for end-to-end tests."""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jitney.client.channel import TlsFiles, open_channel
from jitney.scheduler.launch.supervisor import remove_stale_socket_dirs
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]   # the repository (tests/support/ is two below it)


def free_port() -> int:
    """A TCP port nothing listens on now (the caller binds it a moment later).

    Under pytest-xdist (`make test` runs two workers) each worker draws
    ports in turn from its own range, below Linux's ephemeral ports, so two
    workers never pick the same one between the pick and the bind; alone,
    the kernel picks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")     # "gw0", "gw1", ...
    if not worker.removeprefix("gw").isdigit():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    low = PORT_RANGE_START + int(worker.removeprefix("gw")) % 4 * PORT_RANGE_SIZE
    for _ in range(PORT_RANGE_SIZE):
        port = low + next(_port_turns) % PORT_RANGE_SIZE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{low + PORT_RANGE_SIZE - 1}")


# Worker k of pytest-xdist draws from [START + k * SIZE, START + (k + 1) * SIZE).
PORT_RANGE_START, PORT_RANGE_SIZE = 12000, 5000
_port_turns = itertools.count(random.randrange(PORT_RANGE_SIZE))


@dataclass
class Server:
    target: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    tls: TlsFiles | None = None          # how to reach it (None: plaintext)
    api_key: str | None = field(default=None, repr=False)
    _channel: grpc.Channel | None = field(default=None, repr=False)

    def stub(self) -> pb_grpc.GenerationServiceStub:
        """A stub on the server's one shared channel (opened on first use, closed with the server)."""
        if self._channel is None:
            self._channel = open_channel(self.target, tls=self.tls, api_key=self.api_key)
        return pb_grpc.GenerationServiceStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> pb.GetServerStatsResponse:
        return self.stub().GetServerStats(pb.GetServerStatsRequest(), timeout=10)


def health_status(target: str, timeout: float = 2.0, tls: TlsFiles | None = None) -> int | None:
    with open_channel(target, tls=tls) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return None


@contextmanager
def running_server(args: list[str], log_dir: Path, *, command: str = "serve",
                   wait_serving: bool = True, startup_timeout: float = 240.0,
                   python: str = sys.executable, tls: TlsFiles | None = None,
                   api_key: str | None = None, standby: bool = False,
                   env: dict[str, str] | None = None) -> Iterator[Server]:
    """Run `jitney <command> --port P <args>` until the block ends.

    ``python``: the interpreter whose ``jitney`` runs (another build's, to
    compare); it runs outside this checkout, whose ``jitney/`` would shadow its own.
    ``tls`` / ``api_key``: how the harness reaches a server started with
    ``--tls-cert`` / ``--api-key-file`` in ``args`` (health needs no key).
    ``standby``: keep `jitney serve`'s standby worker (its default on the CPU).
    Off unless asked for: a standby loads a second model a few seconds after
    start, which would compete for this 2-core machine's CPU with what a test
    or a benchmark measures; the tests and benchmarks of recovery turn it on.
    ``env``: more environment variables for the server.
    """
    port = free_port()
    log_path = log_dir / f"jitney-{command}-{port}.log"
    cmd = [python, "-m", "jitney.cli", command, "--port", str(port), *args]
    if command == "serve" and not standby and python == sys.executable:   # (older builds have none)
        cmd.append("--no-standby-worker")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT if python == sys.executable else log_dir,
                                start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = Server(f"127.0.0.1:{port}", proc, log_path, tls, api_key)
    try:
        if wait_serving:
            _wait_serving(server, startup_timeout)
        yield server
    finally:
        server.close()
        _stop(proc)


def replay_on_fresh_server(args: list[str], items: list[Any], log_dir: Path, what: str) -> tuple[list[Any], float]:
    """``items`` (``jitney.client.bench.WorkItem``) replayed by `jitney bench`'s client on a fresh
    ``jitney serve args``: the outcomes and the wall seconds. A traceback in the server's log
    raises, named by ``what``."""
    import asyncio

    from jitney.client.bench import replay
    with running_server(args, log_dir) as server:
        outcomes, wall = asyncio.run(replay(server.target, items, None, show_progress=False))
        log = server.log()
    if "Traceback" in log:
        raise RuntimeError(f"{what}: the server logged a traceback:\n{log[-4000:]}")
    return outcomes, wall


def _wait_serving(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        if health_status(server.target, 1.0, server.tls) == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.3)
    raise TimeoutError(f"server not SERVING after {timeout} s:\n{server.log()}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    except ProcessLookupError:
        pass
    proc.wait()
    remove_stale_socket_dirs(proc.pid, wait=5.0)   # a `jitney serve` killed above (or by the test) left it
