"""The worker's hang watchdog (``--hang-timeout``).

Over tcp:// the scheduler cannot kill a hung worker by pid: it declares it
lost and serves a new one, but a worker stuck in a step (a deadlocked
collective, a driver stall) could wake much later. The watchdog ends such a
worker itself: the serve loop re-arms it before every step and every wait
for a message, and if it is not re-armed within the timeout, Python's
``faulthandler`` dumps every thread's stack to stderr (for the bug report)
and exits the process with status 1, so the supervisor or compose starts a
fresh one. ``faulthandler`` waits in a C thread of its own, so it fires even
while the main thread holds the GIL in a stuck operation.

It is armed only after Ready (loading and warm-up may take minutes), and
only when the loop runs in the main thread: its timer is process-wide and
exits the whole process (tests run worker loops in threads).
"""

from __future__ import annotations

import faulthandler
import sys
import threading


class Watchdog:
    """Exit the process unless ``arm`` is called again within ``seconds`` (0 = off)."""

    def __init__(self, seconds: float) -> None:
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.seconds = seconds if seconds > 0 and on_main_thread else 0.0

    def arm(self) -> None:
        """Start (or restart) the countdown."""
        if self.seconds:
            faulthandler.dump_traceback_later(self.seconds, exit=True, file=sys.stderr)

    def disarm(self) -> None:
        if self.seconds:
            faulthandler.cancel_dump_traceback_later()
