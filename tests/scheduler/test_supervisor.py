"""The supervisor's restart policy (scheduler/launch/supervisor.py), with stand-in
processes: a worker that dies serving is restarted at once; one that dies
before its Ready backs off and, past the limit, stops `jitney serve`."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from jitney.common.supervision import READY_FD_ENV, STANDBY_FD_ENV
import pytest

from jitney.scheduler.launch import supervisor
from jitney.scheduler.launch.supervisor import _Supervisor

# A stand-in worker: logs its start time, waits to be activated if it is a
# standby (logging that time with a minus sign), says Ready (or not), lives a
# while, dies. It is started with SIGTERM blocked; the supervisor sends one
# only once it has let go of it, which ends a real worker: so SIGTERM's
# default here, unblocked (as a real worker unblocks it once its handler is set).
WORKER = f"""
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})
with open(sys.argv[1], "a") as log:
    log.write(f"{{time.monotonic()}}\\n")
standby = os.environ.get("{STANDBY_FD_ENV}")
if standby is not None:
    if os.read(int(standby), 1) != b"g":
        sys.exit(0)
    with open(sys.argv[1], "a") as log:
        log.write(f"-{{time.monotonic()}}\\n")
if sys.argv[2] == "ready":
    fd = int(os.environ["{READY_FD_ENV}"])
    os.write(fd, b"r")
    os.close(fd)
time.sleep(float(sys.argv[3]))
sys.exit(3)
"""


def _events(log: Path) -> list[float]:
    return [float(line) for line in log.read_text().split()] if log.exists() else []


def _supervise(tmp_path: Path, ready: str, lives: float, scheduler_seconds: float,
               max_restarts: int = 5, standby: bool = False) -> tuple[int, list[float]]:
    log = tmp_path / "starts"
    scheduler = [sys.executable, "-c", f"import time; time.sleep({scheduler_seconds})"]
    worker = [sys.executable, "-c", WORKER, str(log), ready, str(lives)]
    code = _Supervisor(scheduler, worker, max_restarts, drain_seconds=1.0, standby=standby).run()
    return code, _events(log)


def test_a_worker_that_dies_serving_is_restarted_at_once_and_without_limit(tmp_path: Path) -> None:
    code, starts = _supervise(tmp_path, "ready", lives=0.3, scheduler_seconds=4.0, max_restarts=1)
    # Each start blocked SIGTERM only around its fork and exec: this process's mask is back.
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert all(t > 0 for t in starts)     # no standby: nothing was activated
    assert code == 0                      # the scheduler's own status: nothing gave up
    assert len(starts) >= 5, starts       # far past --max-worker-restarts 1
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # Each gap is the worker's life (0.3 s) plus its interpreter start: no backoff.
    assert max(gaps) < 0.3 + 0.5 + 1.0, gaps


def test_a_worker_that_dies_before_ready_backs_off_then_stops_serve(tmp_path: Path) -> None:
    code, starts = _supervise(tmp_path, "not-ready", lives=0.0, scheduler_seconds=60.0, max_restarts=2)
    assert code == 1                      # gave up long before the scheduler's 60 s
    assert len(starts) == 3, starts       # the first start and two restarts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0, gaps   # 0.5 s, then 1 s of backoff


def test_a_standby_takes_over_at_once_and_another_starts_behind_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "STANDBY_DELAY_SECONDS", 0.2)
    monkeypatch.setattr(supervisor, "QUIET_SECONDS", 0.3)
    code, events = _supervise(tmp_path, "ready", lives=1.5, scheduler_seconds=5.0, standby=True)
    assert code == 0
    starts = [t for t in events if t > 0]
    activations = [-t for t in events if t < 0]
    assert len(activations) >= 2, events            # two deaths while serving, each taken over
    # Each standby started before the death it covered (loaded ahead) ...
    assert all(any(s < a - 0.5 for s in starts) for a in activations)
    # ... and each activation followed a death within the supervisor's poll, not a process start.
    deaths = [t + 1.5 for t in [starts[0]] + activations[:-1]]   # each serving worker lives 1.5 s
    for died, took_over in zip(deaths, activations):
        assert took_over - died < 1.0, (died, took_over)


# A stand-in worker that says Ready, then keeps a core busy for argv[2] seconds
# (logging when it stops) and sleeps: traffic right after Ready.
BUSY_WORKER = f"""
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})    # (as WORKER's)
if os.environ.get("{STANDBY_FD_ENV}") is not None:
    with open(sys.argv[1], "a") as log:
        log.write(f"standby {{time.monotonic()}}\\n")
    time.sleep(60)
fd = int(os.environ["{READY_FD_ENV}"])
os.write(fd, b"r")
os.close(fd)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
with open(sys.argv[1], "a") as log:
    log.write(f"quiet {{time.monotonic()}}\\n")
time.sleep(60)
"""


@pytest.mark.parametrize("loads_idle", [False, True])
def test_the_standby_waits_for_the_serving_worker_to_be_quiet_unless_it_loads_idle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loads_idle: bool) -> None:
    monkeypatch.setattr(supervisor, "STANDBY_DELAY_SECONDS", 0.2)
    monkeypatch.setattr(supervisor, "QUIET_SECONDS", 0.5)
    monkeypatch.setattr(supervisor, "may_leave_idle_policy", lambda: loads_idle)
    log = tmp_path / "events"
    scheduler = [sys.executable, "-c", "import time; time.sleep(4.5)"]
    worker = [sys.executable, "-c", BUSY_WORKER, str(log), "2.0"]
    assert _Supervisor(scheduler, worker, 5, drain_seconds=1.0, standby=True).run() == 0
    events = {kind: float(t) for kind, t in (line.split() for line in log.read_text().splitlines())}
    assert "standby" in events, events
    if loads_idle:
        # At idle priority it takes only idle cycles: it starts after the delay.
        assert events["standby"] < events["quiet"] - 1.0, events
    else:
        # Busy for 2 s from Ready, far past the 0.2 s delay: the standby started
        # only once the worker had been quiet for 0.5 s.
        assert events["standby"] > events["quiet"] + 0.3, events


# A stand-in rank: logs "start <rank> <pid> <time>", rank 0 says Ready; rank 1 dies
# after a while in the first group only (its log line marks the group), the rest live on.
RANK = f"""
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})    # (as WORKER's)
args = sys.argv[sys.argv.index("--tp-rank") + 1:]
rank, log = int(args[0]), sys.argv[1]
with open(log, "a") as f:
    f.write(f"start {{rank}} {{os.getpid()}} {{time.monotonic()}}\\n")
starts = sum(1 for line in open(log) if line.startswith("start 1 "))
if rank == 0:
    fd = int(os.environ["{READY_FD_ENV}"])
    os.write(fd, b"r")
    os.close(fd)
    time.sleep(60)
time.sleep(0.5 if starts == 1 else 60)
sys.exit(4)
"""


def test_a_tensor_parallel_group_is_restarted_whole_when_one_rank_dies(tmp_path: Path) -> None:
    log = tmp_path / "ranks"
    scheduler = [sys.executable, "-c", "import time; time.sleep(4)"]
    worker = [sys.executable, "-c", RANK, str(log)]
    code = _Supervisor(scheduler, worker, 1, drain_seconds=1.0, standby=True, tp_size=2).run()
    assert code == 0
    starts = [line.split() for line in log.read_text().splitlines()]
    assert sorted(rank for _, rank, _, _ in starts) == ["0", "0", "1", "1"], starts   # two groups, no standby
    first_rank0 = next(int(pid) for _, rank, pid, _ in starts if rank == "0")
    # The first group's rank 0 was alive when rank 1 died: the supervisor killed it.
    with pytest.raises(ProcessLookupError):
        os.kill(first_rank0, 0)
