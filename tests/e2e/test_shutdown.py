"""Stopping a server the usual ways, and starting one where another listens.

* SIGTERM to `jitney serve`'s whole process group (systemd's stop,
  `timeout`, `kill -- -PGID`) drains like SIGTERM to its pid: the worker
  ignores it while supervised and exits on the scheduler's Shutdown, the
  standby is let go without a word of error, nothing is logged at ERROR, the
  ipc:// folder is gone afterwards.
* A door whose port another server listens on stops the start with exit
  status 2 and a message naming the port and the door: gRPC, the OpenAI
  API, metrics (`jitney serve`, `jitney scheduler`), the router's port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from tests.support.server_harness import ROOT, free_port, running_server
from tests.support.tiny_models import make_tiny_llama
from jitney.client.client import Sampling, make_params
from jitney.common.supervision import SUPERVISOR_FD_ENV
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.launch import supervisor
from jitney.v1 import generation_pb2 as pb
from jitney.worker import main as worker_main
from tests.support.worker_link_harness import FakeWorkerSockets, heartbeat_frame, run_on_link

DRAIN_SECONDS = 20


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


# -- the worker's SIGTERM while supervised -------------------------------------

def test_a_supervised_worker_ignores_sigterm_until_its_supervisor_lets_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert threading.current_thread() is threading.main_thread()   # where handlers can be set
    read, write = os.pipe()
    monkeypatch.setenv(SUPERVISOR_FD_ENV, str(read))
    try:
        with worker_main._sigterm_exits():
            os.kill(os.getpid(), signal.SIGTERM)     # a group SIGTERM: ignored
            time.sleep(0.05)
            os.close(write)                          # the supervisor lets go ...
            write = -1
            with pytest.raises(worker_main._Terminated):
                os.kill(os.getpid(), signal.SIGTERM)  # ... and its SIGTERM ends the worker
                time.sleep(1)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    monkeypatch.delenv(SUPERVISOR_FD_ENV, raising=False)   # (read once: gone already)
    with pytest.raises(worker_main._Terminated):       # run alone: SIGTERM ends it at once
        with worker_main._sigterm_exits():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)


def test_a_worker_told_to_shut_down_exits_without_an_error_or_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The drain's end: Shutdown, then the worker's connection closes. That is
    no loss (no ERROR ... lost), and a heartbeat it sent before it read the
    Shutdown is no stale frame to warn of."""
    async def body(w: FakeWorkerSockets) -> None:
        await w.serve_first()
        await w.link.send_shutdown()
        got = engine_pb2.SchedulerMessage.FromString(await w.pull.recv())
        assert got.WhichOneof("kind") == "shutdown" and not w.link.is_serving
        await w.send(heartbeat_frame())
        w.workers[0].close()           # it exits
        for _ in range(50):
            if w.link.num_connections == 0:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert w.link.num_connections == 0

    with caplog.at_level(logging.INFO, logger="jitney.scheduler"):
        run_on_link(body, tmp_path)
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == []
    assert any("to shut down" in r.getMessage() for r in caplog.records)


# -- the supervisor, with stand-in processes --------------------------------------

# A stand-in scheduler: on SIGTERM it "drains" for a while, then exits 0.
SCHEDULER = """
import signal, sys, time
log = sys.argv[1]
def drain(signum, frame):
    time.sleep(1.5)
    with open(log, "a") as f:
        f.write(f"scheduler-exit {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
time.sleep(120)
"""

# A stand-in worker: logs how it was started, says Ready unless a standby,
# then lives until the supervisor lets go of it (its lifeline ends), as a real
# one exits on the scheduler's Shutdown; it logs when.
WORKER = f"""
import os, select, signal, sys, time
log = sys.argv[1]
standby = "JITNEY_STANDBY_FD" in os.environ
blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
with open(log, "a") as f:
    f.write(f"start {{'standby' if standby else 'worker'}} blocked={{blocked}} "
            f"lifeline={{'{SUPERVISOR_FD_ENV}' in os.environ}}\\n")
if not standby:
    fd = int(os.environ["JITNEY_READY_FD"])
    os.write(fd, b"r")
    os.close(fd)
lifeline = select.poll()
lifeline.register(int(os.environ["{SUPERVISOR_FD_ENV}"]), select.POLLIN)
while not lifeline.poll(50):
    pass
with open(log, "a") as f:
    f.write(f"{{'standby' if standby else 'worker'}}-exit {{time.monotonic()}}\\n")
"""

SUPERVISE = """
import sys
from jitney.scheduler.launch import supervisor
supervisor.STANDBY_DELAY_SECONDS = 0.2
scheduler = [sys.executable, "-c", sys.argv[1], sys.argv[3]]
worker = [sys.executable, "-c", sys.argv[2], sys.argv[3]]
sys.exit(supervisor._Supervisor(scheduler, worker, 5, drain_seconds=5.0, standby=True).run())
"""


def test_a_group_sigterm_leaves_the_worker_to_the_drain_and_lets_the_standby_go(tmp_path: Path) -> None:
    log = tmp_path / "events"
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISE, SCHEDULER, WORKER, str(log)], cwd=ROOT,
                            start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while "start standby" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr and proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = log.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start ")]
    assert starts == ["start worker blocked=True lifeline=True", "start standby blocked=True lifeline=True"]
    times = {line.split()[0]: float(line.split()[1]) for line in lines if "-exit " in line}
    # The worker lived through the drain; the standby was let go at once.
    assert times["worker-exit"] >= times["scheduler-exit"], lines
    assert times["standby-exit"] < times["scheduler-exit"], lines
    assert "exited with status" not in stderr and "killing" not in stderr, stderr
    assert _group_gone(proc.pid)


def test_sigterm_again_while_the_scheduler_exits_does_not_kill_it(tmp_path: Path) -> None:
    """Under a group SIGTERM the scheduler gets two: the group's and the one
    the supervisor passes on. An idle scheduler's drain is over at once, and
    the second must not land on SIGTERM's default action while it exits."""
    proc = subprocess.Popen([sys.executable, "-m", "jitney.cli", "scheduler", "--port", str(free_port()),
                             "--plan-addr", f"ipc://{tmp_path}/plan", "--result-addr", f"ipc://{tmp_path}/result"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "result").exists():      # bound: its signal handlers follow at once
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.5)
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- a real server: the group signal and the plain one -------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["group", "pid", "group-tp2"])
def test_sigterm_drains_a_long_stream_and_exits_0_without_an_error(
        model: Path, tmp_path_factory: pytest.TempPathFactory, to: str) -> None:
    # A private temporary folder (short: it holds the ipc:// socket paths), to see what is left in it.
    tmp = tmp_path_factory.mktemp("t")
    args = ["--model", str(model), "--num-blocks", "160", "--dtype", "float32",
            "--drain-seconds", str(DRAIN_SECONDS)]
    tp = to.endswith("-tp2")
    if tp:      # two ranks, both reached by a group SIGTERM (no standby under tensor parallelism)
        args += ["--tensor-parallel-size", "2", "--threads", "1"]
    # Else the standby too (its default on the CPU): a group SIGTERM reaches it as well.
    with running_server(args, tmp_path_factory.mktemp("logs"), standby=not tp, env={"TMPDIR": str(tmp)}) as srv:
        deadline = time.monotonic() + 120
        while not tp and "standby: loaded and warm" not in srv.log():
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
        params = make_params([3, 4], sampling=Sampling(max_tokens=400, ignore_eos=True))
        call = srv.stub().GenerateStream(pb.GenerateStreamRequest(params=params), timeout=120)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 20:
                break
        if to.startswith("group"):
            os.killpg(srv.proc.pid, signal.SIGTERM)
        else:
            srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        last = None
        for msg in call:
            got += len(msg.token_ids)
            last = msg
        assert got == 400 and last is not None and last.finish_reason == pb.FINISH_REASON_LENGTH, srv.log()
        assert srv.proc.wait(timeout=DRAIN_SECONDS + 5) == 0, srv.log()
        took = time.monotonic() - signalled
        log = srv.log()
    assert took < DRAIN_SECONDS, log
    assert [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line] == [], log
    assert "exited with status" not in log, log
    assert log.count("shutdown requested") == 1, log
    if tp:
        assert "tensor-parallel over 2 ranks" in log and "rank 1: shutdown relayed by rank 0" in log, log
    assert _group_gone(srv.proc.pid), log
    assert list(tmp.glob("jitney-*")) == [], log


# -- the ipc:// folder of a `jitney serve` that was killed ------------------------------

def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on (its process is gone)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


def test_the_ipc_folders_of_killed_supervisors_are_removed_and_no_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"jitney-{dead_pid}-stale"
    stale.mkdir()
    _stale_socket(stale / "plan")
    _stale_socket(stale / "result")
    orphaned = tmp_path / f"jitney-{dead_pid}-live"   # its scheduler outlived the supervisor
    orphaned.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(orphaned / "plan"))
    listener.listen()
    alive = tmp_path / f"jitney-{os.getppid()}-alive"          # a supervisor that runs
    alive.mkdir()
    other = tmp_path / "jitney-gpu-bench-x"                    # not a supervisor's
    other.mkdir()
    try:
        assert supervisor.remove_stale_socket_dirs() == [stale]
    finally:
        listener.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (orphaned, alive, other))
    # Once its scheduler is gone too, the orphaned one goes.
    assert supervisor.remove_stale_socket_dirs(dead_pid, wait=5.0) == [orphaned]


# -- a port in use ---------------------------------------------------------------------

@contextmanager
def _held_port() -> Iterator[int]:
    """A port another server listens on (a plain socket)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jitney.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp)})


@pytest.mark.parametrize("door,what", [("--port", "gRPC"), ("--openai-port", "the OpenAI API"),
                                       ("--metrics-port", "metrics")])
@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_a_door_on_a_port_in_use_stops_the_start_with_status_2(
        tmp_path_factory: pytest.TempPathFactory, command: str, door: str, what: str) -> None:
    tmp = tmp_path_factory.mktemp("t")
    with _held_port() as held:
        ports = {"--port": free_port(), "--openai-port": free_port(), "--metrics-port": free_port(), door: held}
        args = [command, *(a for flag, port in ports.items() for a in (flag, str(port)))]
        if command == "scheduler":    # the scheduler's own bind, the authority
            args += ["--plan-addr", f"ipc://{tmp}/plan", "--result-addr", f"ipc://{tmp}/result"]
        else:
            args += ["--no-standby-worker"]
        done = _run(args, tmp)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{held} for {what} ({door} {held})" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if command == "serve":      # refused before any process started
        assert "gRPC listening" not in done.stdout + done.stderr
        assert list(tmp.glob("jitney-*")) == []


def test_serve_refuses_a_port_that_a_reuseport_grpc_server_listens_on(tmp_path: Path) -> None:
    """gRPC's default (SO_REUSEPORT) would let a second such server share the
    port with the first; Jitney's bind does not, and says so."""
    first = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        done = _run(["serve", "--port", str(port), "--no-standby-worker"], tmp_path)
        sched = _run(["scheduler", "--port", str(port), "--plan-addr", f"ipc://{tmp_path}/plan",
                      "--result-addr", f"ipc://{tmp_path}/result"], tmp_path)
    finally:
        first.stop(None)
    for run_ in (done, sched):
        assert run_.returncode == 2, run_.stderr
        assert f"cannot listen on 127.0.0.1:{port} for gRPC (--port {port})" in run_.stderr, run_.stderr


def test_the_router_refuses_a_port_in_use(tmp_path: Path) -> None:
    with _held_port() as held:
        done = _run(["router", "--port", str(held), "--replica", "127.0.0.1:1", "--no-tokenizer"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{held} (--port {held})" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_port_check_binds_as_the_doors_do() -> None:
    from jitney.common.ports import bind_problem

    with _held_port() as held:
        problem = bind_problem("127.0.0.1", held)
        assert problem is not None and "in use" in str(problem)
        assert bind_problem("localhost", held) is not None    # one of localhost's addresses is taken
    free = free_port()
    assert bind_problem("127.0.0.1", free) is None
    # A port in TIME_WAIT (a server that just stopped) can be listened on again.
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", free))
        server.listen()
        client = socket.create_connection(("127.0.0.1", free))
        conn, _ = server.accept()
        conn.close()       # the server's side closes first: TIME_WAIT on its port
        client.close()
    assert bind_problem("127.0.0.1", free) is None
