"""`jitney serve`: start the scheduler and one worker process, supervise both.

The two talk over ipc:// sockets in a private temporary folder. SIGINT and
SIGTERM are passed on to both; when either process exits, the other is
stopped and `jitney serve` exits with the first one's status.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time

STOP_GRACE_SECONDS = 10.0


def child_argv(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[str]:
    """Re-create the command line of ``parser``'s flags from ``ns``."""
    argv: list[str] = []
    for action in parser._actions:  # argparse has no public iterator over actions
        if not action.option_strings or action.dest == "help" or not hasattr(ns, action.dest):
            continue
        value = getattr(ns, action.dest)
        if value is None or value is False:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if value is True and action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def supervise(scheduler_argv: list[str], worker_argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="jitney-") as tmp:
        addrs = ["--plan-addr", f"ipc://{tmp}/plan", "--result-addr", f"ipc://{tmp}/result"]
        base = [sys.executable, "-m", "client.cli"]
        procs = {
            "scheduler": subprocess.Popen(base + ["scheduler", *scheduler_argv, *addrs]),
            "worker": subprocess.Popen(base + ["worker", *worker_argv, *addrs]),
        }
        stopping = False

        def forward(signum: int, _frame: object) -> None:
            nonlocal stopping
            stopping = True
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signum)

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        name, code = _wait_first(procs)
        if not stopping and code != 0:
            print(f"jitney: the {name} process exited with status {code}; stopping", file=sys.stderr, flush=True)
        _stop_all(procs)
        return code if code >= 0 else 128 - code


def _wait_first(procs: dict[str, subprocess.Popen[bytes]]) -> tuple[str, int]:
    while True:
        for name, proc in procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        time.sleep(0.1)


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


