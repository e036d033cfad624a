"""Background work that must not slow the serving worker: the standby's load.

On a machine with a few cores, a standby worker that loads the model while
the first traffic runs takes those cores from the serving worker (on this
2-core CPU offline-64 right after Ready took 1.12x as long with the standby
loading meanwhile; bench/first_run.py). One guard or the other:

    where                           what
    the standby may come back from  it loads and warms up at ``SCHED_IDLE`` (it
    SCHED_IDLE (CAP_SYS_NICE, or    runs only on a core nothing else wants; the
    RLIMIT_NICE: root outside a     threads it starts inherit that) and every
    container, say)                 thread is back at the normal policy before it
                                    waits to take over; the supervisor starts it
                                    a few seconds after the serving worker's Ready
                                    (first replay of offline-64 with it 1.033x as
                                    long as without, against 1.116x unguarded)
    elsewhere                       the supervisor starts it only once the serving
                                    worker has been quiet (``CpuQuiet``: under
                                    ``QUIET_CPU`` of a core over ``QUIET_SECONDS``),
                                    or after ``QUIET_MAX_WAIT_SECONDS`` of serving
                                    without a quiet moment (the fast takeover is
                                    worth a few contended seconds once), and it
                                    loads at the normal policy (1.005x)

Both read Linux's /proc; elsewhere the first is a plain delay and the second
does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

logger = logging.getLogger(__name__)

QUIET_SECONDS = 2.0          # how long the serving worker must have been quiet
QUIET_CPU = 0.1              # ... using under this many cores on average
QUIET_MAX_WAIT_SECONDS = 300.0
_SAMPLE_SECONDS = 0.25
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (None: unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()    # after "pid (comm) "; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS   # utime, stime


class CpuQuiet:
    """Whether some processes have used little CPU for a while, from samples
    taken as ``quiet()`` is called (the supervisor's poll loop)."""

    def __init__(self, seconds: float = QUIET_SECONDS, cores: float = QUIET_CPU) -> None:
        self.seconds, self.cores = seconds, cores
        self._samples: deque[tuple[float, float]] = deque()
        self._pids: tuple[int, ...] = ()

    def quiet(self, pids: Sequence[int], now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if tuple(pids) != self._pids:       # another worker: start over
            self._pids, self._samples = tuple(pids), deque()
        if self._samples and now - self._samples[-1][0] < _SAMPLE_SECONDS:
            return self._judge()
        used = [cpu_seconds(p) for p in pids]
        if any(u is None for u in used):
            return True                      # no /proc: nothing to wait on
        self._samples.append((now, sum(u for u in used if u is not None)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.seconds:
            self._samples.popleft()
        return self._judge()

    def _judge(self) -> bool:
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return t1 - t0 >= self.seconds and (c1 - c0) / (t1 - t0) < self.cores


def may_leave_idle_policy() -> bool:
    """Whether a thread of this process that goes ``SCHED_IDLE`` may come back
    (tried on a throwaway thread, so no thread that matters is left idle)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def trial() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            result.append(False)
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=trial, name="sched-trial")
    t.start()
    t.join()
    return bool(result and result[0])


def _set_policy_of_all_threads(policy: int) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except ProcessLookupError:
            pass                             # a thread that ended meanwhile


@contextmanager
def idle_priority() -> Iterator[bool]:
    """Run the block at ``SCHED_IDLE`` (threads it starts inherit it), and every
    thread of the process back at ``SCHED_OTHER`` after it; yields whether it
    did (only where the way back is allowed)."""
    if not may_leave_idle_policy():
        yield False
        return
    _set_policy_of_all_threads(os.SCHED_IDLE)
    try:
        yield True
    finally:
        _set_policy_of_all_threads(os.SCHED_OTHER)
