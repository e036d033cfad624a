"""The standby's guards (jitney/common/background.py): the serving worker's
quiet moments read from /proc, and a load at SCHED_IDLE with every thread
back at the normal policy after it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from jitney.common import background
from jitney.common.background import CpuQuiet, cpu_seconds, idle_priority

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def _watch(quiet: CpuQuiet, pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    result = quiet.quiet([pid])
    while time.monotonic() < end:
        time.sleep(0.05)
        result = quiet.quiet([pid])
    return result


def test_a_busy_process_is_not_quiet_and_a_sleeping_one_is() -> None:
    busy = _child("while True: pass")
    sleeping = _child("import time; time.sleep(30)")
    try:
        time.sleep(0.3)     # past both interpreters' start
        assert not _watch(CpuQuiet(seconds=0.6, cores=0.1), busy.pid, 1.2)
        assert _watch(CpuQuiet(seconds=0.6, cores=0.1), sleeping.pid, 1.2)
        # Not before the window is full, however idle.
        assert not CpuQuiet(seconds=0.6, cores=0.1).quiet([sleeping.pid])
    finally:
        for p in (busy, sleeping):
            p.kill()
            p.wait()


def test_cpu_seconds_counts_this_process_and_not_a_missing_one() -> None:
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after - before >= 0.1
    dead = _child("pass")
    dead.wait()
    assert cpu_seconds(dead.pid) is None


def _policies() -> dict[int, int]:
    return {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")}


@pytest.fixture
def parked_thread() -> Iterator[threading.Event]:
    """A thread started inside the idle block that outlives it (as torch's pool does)."""
    stop = threading.Event()
    yield stop
    stop.set()


def test_idle_priority_covers_threads_started_inside_and_restores_them_all(
        parked_thread: threading.Event) -> None:
    if not background.may_leave_idle_policy():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20)")
    with idle_priority() as idle:
        assert idle
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
        t = threading.Thread(target=parked_thread.wait, daemon=True)
        t.start()
        assert os.sched_getscheduler(t.native_id) == os.SCHED_IDLE   # inherited
    assert set(_policies().values()) == {os.SCHED_OTHER}
    assert t.is_alive()


def test_without_a_way_back_the_load_keeps_the_normal_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "may_leave_idle_policy", lambda: False)
    with idle_priority() as idle:
        assert not idle
        assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_an_unprivileged_process_may_not_leave_idle() -> None:
    """What the trial answers where the kernel refuses the way back: an ordinary
    user (no CAP_SYS_NICE) with the default RLIMIT_NICE of 0."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become an ordinary user")
    code = ("import os, resource\n"
            "from jitney.common.background import may_leave_idle_policy\n"
            "resource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n"
            "os.setgid(65534)\n"
            "os.setuid(65534)\n"
            "print(may_leave_idle_policy(), os.sched_getscheduler(0) == os.SCHED_OTHER)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]     # refused, and the caller's thread untouched
