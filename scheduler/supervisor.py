"""`jitney serve`: start the scheduler and one worker process, supervise both.

The two talk over ipc:// sockets in a private temporary folder.

    event                       what the supervisor does
    worker exits after its      start a new one at once: the worker died
    Ready (not asked)           serving (killed, out of memory), and every
                                second counts. The scheduler fails its
                                requests and serves the new one's Ready.
    worker exits before its     a crash loop: start a new one after a backoff
    Ready                       (0.5 s, 1 s, 2 s ... up to 10 s); more than
                                --max-worker-restarts of these within 5
                                minutes: stop everything.
    scheduler exits             stop the worker, exit with the scheduler's status
    SIGTERM                     pass it to the scheduler only: it drains, tells
                                the worker to shut down, and both exit 0
    SIGINT                      pass it to both (they stop at once)

A worker tells the supervisor it is ready through a pipe
(``jitney.common.supervision``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from jitney.common.supervision import READY_FD_ENV

STOP_GRACE_SECONDS = 10.0
RESTART_WINDOW_SECONDS = 300.0
MAX_BACKOFF_SECONDS = 10.0
POLL_SECONDS = 0.05


def add_supervisor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-worker-restarts", type=int, default=5,
                        help="restarts of a worker that died before it was ready allowed within "
                             "5 minutes before `jitney serve` gives up (default 5; 0 = never); "
                             "a worker that dies while serving is always restarted at once")


def child_argv(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[str]:
    """Re-create the command line of ``parser``'s flags from ``ns``."""
    argv: list[str] = []
    for action in parser._actions:  # argparse has no public iterator over actions
        if not action.option_strings or action.dest == "help" or not hasattr(ns, action.dest):
            continue
        value = getattr(ns, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):   # --flag / --no-flag
            if value is not None:
                argv.append(action.option_strings[0] if value else action.option_strings[1])
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:   # store_true / store_false / store_const: given iff not the default
            if value != action.default:
                argv.append(flag)
            continue
        if value is None or value is False:
            continue
        argv += [flag, str(value)]
    return argv


@dataclass
class _Supervisor:
    scheduler_cmd: list[str]
    worker_cmd: list[str]
    max_worker_restarts: int
    drain_seconds: float
    scheduler: subprocess.Popen[bytes] = field(init=False)
    worker: subprocess.Popen[bytes] | None = field(init=False, default=None)
    stopping_since: float | None = None
    restarts: list[float] = field(default_factory=list)   # times of recent crash-loop restarts
    restart_at: float | None = None
    worker_ready: bool = False          # the current worker sent its Ready
    _ready_pipe: int | None = None      # read end of the current worker's ready pipe

    def run(self) -> int:
        self.scheduler = subprocess.Popen(self.scheduler_cmd)
        self._start_worker()
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            while (code := self.scheduler.poll()) is None:
                if not self._tend_worker():
                    return 1
                self._enforce_stop_deadline()
                time.sleep(POLL_SECONDS)
            return code if code >= 0 else 128 - code
        finally:
            self._stop_all()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        # SIGTERM: the scheduler drains, then sends the worker Shutdown.
        targets = [self.scheduler] + ([self.worker] if signum == signal.SIGINT and self.worker else [])
        for proc in targets:
            if proc.poll() is None:
                proc.send_signal(signum)

    def _start_worker(self) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        try:
            self.worker = subprocess.Popen(self.worker_cmd, pass_fds=(write_end,),
                                           env={**os.environ, READY_FD_ENV: str(write_end)})
        finally:
            os.close(write_end)
        self._close_ready_pipe()
        self._ready_pipe, self.worker_ready = read_end, False

    def _close_ready_pipe(self) -> None:
        if self._ready_pipe is not None:
            os.close(self._ready_pipe)
            self._ready_pipe = None

    def _poll_ready(self) -> None:
        if self._ready_pipe is None:
            return
        try:
            got = os.read(self._ready_pipe, 1)
        except BlockingIOError:
            return
        self.worker_ready = self.worker_ready or got == b"r"
        self._close_ready_pipe()    # one byte, or the end of the pipe: nothing more will come

    def _tend_worker(self) -> bool:
        """Restart a dead worker when due; False once crash-loop restarts are used up."""
        now = time.monotonic()
        if self.worker is not None:
            self._poll_ready()
            code = self.worker.poll()
            if code is None or self.stopping_since is not None:
                return True
            self._poll_ready()    # a byte written just before it died
            self.worker = None
            self._close_ready_pipe()
            if self.worker_ready:
                print(f"jitney: the worker exited with status {code} while serving; restarting it now",
                      file=sys.stderr, flush=True)
                self.restart_at = now
            else:
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_SECONDS]
                if len(self.restarts) >= self.max_worker_restarts:
                    print(f"jitney: the worker exited with status {code} before it was ready, "
                          f"{len(self.restarts)} times in {RESTART_WINDOW_SECONDS:g} s already; "
                          "stopping", file=sys.stderr, flush=True)
                    return False
                backoff = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** len(self.restarts))
                print(f"jitney: the worker exited with status {code} before it was ready; "
                      f"restarting it in {backoff:g} s", file=sys.stderr, flush=True)
                self.restarts.append(now + backoff)
                self.restart_at = now + backoff
        if self.restart_at is not None and now >= self.restart_at and self.stopping_since is None:
            self.restart_at = None
            self._start_worker()
        return True

    def _enforce_stop_deadline(self) -> None:
        """A scheduler that does not end its drain in time is stopped."""
        if self.stopping_since is None:
            return
        if time.monotonic() - self.stopping_since > self.drain_seconds + STOP_GRACE_SECONDS:
            print("jitney: the scheduler did not stop in time; killing it", file=sys.stderr, flush=True)
            self.scheduler.kill()

    def _stop_all(self) -> None:
        self._close_ready_pipe()
        procs = [p for p in (self.scheduler, self.worker) if p is not None]
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in procs:   # the worker exits by itself after a drain's Shutdown
            try:
                proc.wait(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def supervise(scheduler_argv: list[str], worker_argv: list[str], *,
              max_worker_restarts: int = 5, drain_seconds: float = 30.0) -> int:
    with tempfile.TemporaryDirectory(prefix="jitney-") as tmp:
        addrs = ["--plan-addr", f"ipc://{tmp}/plan", "--result-addr", f"ipc://{tmp}/result"]
        base = [sys.executable, "-m", "jitney.cli"]
        return _Supervisor(base + ["scheduler", *scheduler_argv, *addrs],
                           base + ["worker", *worker_argv, *addrs],
                           max_worker_restarts, drain_seconds).run()
