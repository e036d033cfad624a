"""`jitney serve`: start the scheduler and one worker process, supervise both.

The two talk over ipc:// sockets in a private temporary folder.

    event                       what the supervisor does
    worker exits after its      activate the standby worker (below), else
    Ready (not asked)           start a new one at once: the worker died
                                serving (killed, out of memory), and every
                                second counts. The scheduler fails its
                                requests and serves the new one's Ready.
    worker exits before its     a crash loop: start a new one after a backoff
    Ready                       (0.5 s, 1 s, 2 s ... up to 10 s); more than
                                --max-worker-restarts of these within 5
                                minutes: stop everything.
    worker refuses its model    stop everything at once and exit 2, printing
    (REFUSED_EXIT_CODE)         its reason: no restart can run that model.
    scheduler exits             stop the worker, exit with the scheduler's status
    SIGTERM                     pass it to the scheduler only: it drains, tells
                                the worker to shut down, and both exit 0; let
                                the standby go (it has nothing to drain)
    SIGINT                      pass it to both (they stop at once)

A worker tells the supervisor it is ready through a pipe
(``jitney.common.supervision``). A second pipe, never written, tells it that
it is supervised: it ignores SIGTERM while the supervisor holds that pipe's
write end, so a SIGTERM to the whole process group (systemd's stop,
`timeout`, `kill -- -PGID`) drains like one to the supervisor's pid instead
of killing the serving worker under its requests. Each worker also starts
with SIGTERM blocked, until its own handler is set. To let a worker go, the
supervisor closes that pipe and sends SIGTERM; SIGKILL after
STOP_GRACE_SECONDS.

The ``ipc://`` sockets' folder is ``$TMPDIR/jitney-<supervisor pid>-*``:
removed when `jitney serve` exits, and a folder left by one that was killed
(SIGKILL) is removed by the next start (``remove_stale_socket_dirs``).

Standby (``--standby-worker``, on by default on the CPU): once the worker
serves, a second worker process starts, loads the model, sizes its cache,
warms up, and waits on a pipe without connecting to the scheduler. When the
serving worker dies, one byte on that pipe makes the standby connect and
send its Ready: the scheduler serves again within a fraction of a second,
instead of the seconds a fresh process needs for its imports and its load
(bench/recovery.py). A new standby then starts behind it.

Tensor parallelism (``--tensor-parallel-size N``): the worker is a group of
N processes, ranks 0 .. N-1 of one ``torch.distributed`` group that meets
at a free local port drawn anew for each start (``--dist-init``). Rank 0 is
the worker the scheduler sees; its ready pipe is the group's. The group
lives and dies as one: when any rank exits, the others are killed and a new
group starts, under the policy above (at once after its Ready, with backoff
before). No standby under tensor parallelism: a waiting group would hold
another N processes' shards and rendezvous.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from jitney.common.arg_types import positive_int
from jitney.common import model_files
from jitney.common.background import (QUIET_CPU, QUIET_MAX_WAIT_SECONDS, QUIET_SECONDS, CpuQuiet,
                                      may_leave_idle_policy)
from jitney.common.supervision import (READY_BYTE, READY_FD_ENV, REFUSED_BYTE, REFUSED_EXIT_CODE, STANDBY_FD_ENV,
                                      SUPERVISOR_FD_ENV)

STOP_GRACE_SECONDS = 10.0
RESTART_WINDOW_SECONDS = 300.0
MAX_BACKOFF_SECONDS = 10.0
POLL_SECONDS = 0.05
STANDBY_DELAY_SECONDS = 5.0


def add_supervisor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-worker-restarts", type=int, default=5,
                        help="restarts of a worker that died before it was ready allowed within "
                             "5 minutes before `jitney serve` gives up (default 5; 0 = never); "
                             "a worker that dies while serving is always restarted at once")
    parser.add_argument("--standby-worker", action=argparse.BooleanOptionalAction, default=None,
                        help="keep a second worker loaded and waiting, which takes over within a "
                             "fraction of a second when the serving one dies; it costs one more copy "
                             "of the weights in memory (default: on for --device cpu, off for cuda, "
                             "where it would hold a second KV cache's worth of GPU memory)")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                        help="run the model over N worker processes (one torch.distributed group: gloo on "
                             "the CPU, NCCL on CUDA with one GPU per rank); its heads and MLP are split N ways "
                             "and any rank's death restarts the group (default 1; no standby worker when > 1)")


def tensor_parallel_problem(model: str | None, size: int) -> str | None:
    """Why the model's heads or MLP do not split ``size`` ways (a folder's config.json, a GGUF
    file's metadata, the bundled default's too), before any process starts; None when they do,
    or when the model cannot be resolved here (the worker then reports that)."""
    if size == 1:
        return None
    try:
        sizes = model_files.split_sizes(model_files.resolve_model(model))
    except (model_files.ModelNotFoundError, OSError, ValueError, KeyError):
        return None
    bad = [f"{what} ({value})" for what, value in sizes.items() if value % size]
    if not bad:
        return None
    return f"tensor parallelism over {size} ranks needs the model's {', '.join(bad)} to be divisible by {size}"


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
        if isinstance(value, list):     # a repeatable flag (action="append"): once per value
            for item in value:
                argv += [flag, str(item)]
            continue
        argv += [flag, str(value)]
    return argv


@contextmanager
def _sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread for the block: a worker started inside it
    inherits the mask through fork and exec, so a group SIGTERM that reaches it
    before its handler is set waits for that handler (which unblocks it)
    instead of ending it. This process's own SIGTERM is only delayed, not lost.
    A mask rather than a preexec_fn setting SIG_IGN: preexec_fn runs Python
    between fork and exec, which is unsafe in a process that has threads (a
    test's gRPC threads: their after-fork hook aborted the child)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass(eq=False)
class _WorkerProcess:
    """A worker process and its pipes to the supervisor."""

    proc: subprocess.Popen[bytes]
    ready_pipe: int | None          # read end: one byte once its Ready is sent
    activate_pipe: int | None       # write end (a standby only): one byte starts it
    lifeline: int | None = None     # write end, never written: open, the worker ignores SIGTERM
    ready_since: float | None = None   # when its Ready byte came; None: not (yet) ready
    refusal: str | None = None      # why it refused its model (REFUSED_BYTE on its ready pipe)

    @property
    def ready(self) -> bool:
        return self.ready_since is not None

    @classmethod
    def start(cls, cmd: list[str], *, standby: bool) -> "_WorkerProcess":
        ready_read, ready_write = os.pipe()
        os.set_blocking(ready_read, False)
        lifeline_read, lifeline_write = os.pipe()
        fds = [ready_write, lifeline_read]
        env = {**os.environ, READY_FD_ENV: str(ready_write), SUPERVISOR_FD_ENV: str(lifeline_read)}
        activate_read = activate_write = None
        if standby:
            activate_read, activate_write = os.pipe()
            fds.append(activate_read)
            env[STANDBY_FD_ENV] = str(activate_read)
        try:
            with _sigterm_blocked():
                proc = subprocess.Popen(cmd, pass_fds=fds, env=env)
        except BaseException:
            for fd in (ready_read, activate_write, lifeline_write):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        return cls(proc, ready_read, activate_write, lifeline_write)

    def poll_ready(self) -> bool:
        if self.ready_pipe is not None:
            try:
                got = os.read(self.ready_pipe, 1)
            except BlockingIOError:
                return self.ready
            if got == READY_BYTE and self.ready_since is None:
                self.ready_since = time.monotonic()
            elif got == REFUSED_BYTE:
                self.refusal = _read_rest(self.ready_pipe).decode(errors="replace")
            os.close(self.ready_pipe)    # one byte, or the end of the pipe: nothing more will come
            self.ready_pipe = None
        return self.ready

    def activate(self) -> bool:
        """Tell a standby to connect and send its Ready; False if it is gone."""
        assert self.activate_pipe is not None
        try:
            os.write(self.activate_pipe, b"g")
        except BrokenPipeError:
            return False
        finally:
            os.close(self.activate_pipe)
            self.activate_pipe = None
        return True

    def close(self) -> None:
        """Close its pipes: from now on a SIGTERM ends it (and a standby's wait ends)."""
        for fd in (self.ready_pipe, self.activate_pipe, self.lifeline):
            if fd is not None:
                os.close(fd)
        self.ready_pipe = self.activate_pipe = self.lifeline = None

    def release(self) -> None:
        """Let it go: close its pipes, then SIGTERM (it exits 0)."""
        self.close()
        if self.proc.poll() is None:
            self.proc.terminate()


@dataclass(eq=False)
class _WorkerGroup:
    """The processes of one worker: one, or the N ranks of a tensor-parallel
    group. Rank 0's ready pipe is the group's; any rank's exit ends the group."""

    ranks: list[_WorkerProcess]

    @classmethod
    def start(cls, cmd: list[str], size: int) -> "_WorkerGroup":
        if size == 1:
            return cls([_WorkerProcess.start(cmd, standby=False)])
        rendezvous = ["--tp-size", str(size), "--dist-init", f"tcp://127.0.0.1:{_free_port()}"]
        ranks: list[_WorkerProcess] = []
        try:
            for rank in range(size):
                ranks.append(_WorkerProcess.start(cmd + ["--tp-rank", str(rank), *rendezvous], standby=False))
        except BaseException:
            cls(ranks).kill()
            raise
        return cls(ranks)

    @property
    def lead(self) -> _WorkerProcess:
        return self.ranks[0]

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [r.proc for r in self.ranks]

    def poll(self) -> int | None:
        """The exit status of a rank that exited (the first found), None while all run."""
        for rank in self.ranks:
            code = rank.proc.poll()
            if code is not None:
                return code
        return None

    def kill(self) -> None:
        """End every rank still running (a group missing a rank cannot serve)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self.close()

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


def _read_rest(fd: int) -> bytes:
    """What is left in the non-blocking pipe ``fd`` (a refusal's reason, written in one write)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _free_port() -> int:
    """A TCP port nothing listens on now (rank 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Supervisor:
    scheduler_cmd: list[str]
    worker_cmd: list[str]
    max_worker_restarts: int
    drain_seconds: float
    standby: bool = False               # keep a loaded standby worker (--standby-worker)
    tp_size: int = 1                    # ranks per worker (--tensor-parallel-size); no standby when > 1
    scheduler: subprocess.Popen[bytes] = field(init=False)
    worker: _WorkerGroup | None = field(init=False, default=None)
    spare: _WorkerProcess | None = field(init=False, default=None)   # the standby
    stopping_since: float | None = None
    restarts: list[float] = field(default_factory=list)   # times of recent crash-loop restarts
    restart_at: float | None = None
    spare_at: float | None = None       # when to start the next standby
    standby_loads_idle: bool = False    # at SCHED_IDLE (else it waits for a quiet moment)
    quiet: CpuQuiet = field(default_factory=lambda: CpuQuiet(QUIET_SECONDS, QUIET_CPU))   # the serving worker's
    exit_code: int = 1                  # when the worker gives up: 2 for a refused model

    def run(self) -> int:
        if self.tp_size > 1:
            self.standby = False
        # A standby inherits this process's limits and capabilities: the same answer.
        self.standby_loads_idle = self.standby and may_leave_idle_policy()
        self.scheduler = subprocess.Popen(self.scheduler_cmd)
        self.worker = _WorkerGroup.start(self.worker_cmd, self.tp_size)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            while (code := self.scheduler.poll()) is None:
                if not self._tend_worker():
                    return self.exit_code
                self._tend_spare()
                self._enforce_stop_deadline()
                time.sleep(POLL_SECONDS)
            return code if code >= 0 else 128 - code
        finally:
            self._stop_all()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        # SIGTERM: the scheduler drains, then sends the worker Shutdown (which
        # ignores SIGTERM meanwhile, should one reach it too).
        targets = [self.scheduler] + (self.worker.procs if signum == signal.SIGINT and self.worker else [])
        if self.spare is not None:      # a standby has nothing to drain
            if signum == signal.SIGTERM:
                self.spare.release()
            else:
                targets.append(self.spare.proc)
        for proc in targets:
            if proc.poll() is None:
                proc.send_signal(signum)

    def _crash_backoff(self, what: str, code: int) -> float | None:
        """Seconds to wait before starting again after a death before Ready; None: give up."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_SECONDS]
        if len(self.restarts) >= self.max_worker_restarts:
            print(f"jitney: the {what} exited with status {code} before it was ready, "
                  f"{len(self.restarts)} times in {RESTART_WINDOW_SECONDS:g} s already; "
                  "stopping", file=sys.stderr, flush=True)
            return None
        backoff = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** len(self.restarts))
        print(f"jitney: the {what} exited with status {code} before it was ready; "
              f"starting another in {backoff:g} s", file=sys.stderr, flush=True)
        self.restarts.append(now + backoff)
        return backoff

    def _tend_worker(self) -> bool:
        """Replace a dead worker when due; False once crash-loop restarts are used up or the
        worker refused its model."""
        now = time.monotonic()
        if self.worker is not None:
            self.worker.lead.poll_ready()
            if self.worker.lead.refusal is not None:   # (no need to wait for its exit)
                self.worker.kill()
                return self._refused(self.worker.lead.refusal)
            code = self.worker.poll()
            if code is None or self.stopping_since is not None:
                return True
            dead, self.worker = self.worker, None
            dead.lead.poll_ready()    # a byte written just before it died
            dead.kill()               # the other ranks of its group, if any
            if dead.lead.refusal is not None or code == REFUSED_EXIT_CODE:
                return self._refused(dead.lead.refusal)
            if self.tp_size > 1:
                print(f"jitney: a rank of the tensor-parallel worker group exited with status {code}; "
                      "stopped the group", file=sys.stderr, flush=True)
            if dead.lead.ready:
                if self.spare is not None and self.spare.proc.poll() is None and self.spare.activate():
                    self.worker, self.spare = _WorkerGroup([self.spare]), None
                    print(f"jitney: the worker exited with status {code} while serving; "
                          "activated the standby worker", file=sys.stderr, flush=True)
                    return True
                print(f"jitney: the worker exited with status {code} while serving; restarting it now",
                      file=sys.stderr, flush=True)
                self.restart_at = now
            else:
                backoff = self._crash_backoff("worker", code)
                if backoff is None:
                    return False
                self.restart_at = now + backoff
        if self.restart_at is not None and now >= self.restart_at and self.stopping_since is None:
            self.restart_at = None
            self.worker = _WorkerGroup.start(self.worker_cmd, self.tp_size)
        return True

    def _refused(self, reason: str | None) -> bool:
        """The worker refused its model: nothing to restart. Stops the scheduler; False."""
        print(f"jitney serve: cannot serve this model: {reason or 'the worker refused it (see its log above)'}",
              file=sys.stderr, flush=True)
        self.exit_code = 2
        if self.scheduler.poll() is None:
            self.scheduler.terminate()
        return False

    def _tend_spare(self) -> None:
        """Keep one loaded standby while a worker serves. It starts once that
        worker has served for STANDBY_DELAY_SECONDS and, where it cannot load
        at idle CPU priority, once that worker has also been quiet
        (``jitney.common.background``): its load takes a few CPU seconds,
        which the first traffic after Ready, or the retried requests of a
        lost worker after a takeover, would otherwise wait for."""
        if not self.standby or self.stopping_since is not None:
            return
        now = time.monotonic()
        if self.spare is not None:
            code = self.spare.proc.poll()
            if code is None:
                return
            self.spare.close()
            self.spare = None
            backoff = self._crash_backoff("standby worker", code)
            self.spare_at = now + (backoff if backoff is not None else RESTART_WINDOW_SECONDS)
        serving = self.worker.lead.ready_since if self.worker is not None else None
        if serving is None or (self.spare_at is not None and now < self.spare_at):
            return
        if now - serving < STANDBY_DELAY_SECONDS:
            return
        if (not self.standby_loads_idle and now - serving < QUIET_MAX_WAIT_SECONDS
                and not self.quiet.quiet([p.pid for p in self.worker.procs] if self.worker else [], now)):
            return
        self.spare_at = None
        self.spare = _WorkerProcess.start(self.worker_cmd, standby=True)

    def _enforce_stop_deadline(self) -> None:
        """A scheduler that does not end its drain in time is stopped."""
        if self.stopping_since is None:
            return
        if time.monotonic() - self.stopping_since > self.drain_seconds + STOP_GRACE_SECONDS:
            print("jitney: the scheduler did not stop in time; killing it", file=sys.stderr, flush=True)
            self.scheduler.kill()

    def _stop_all(self) -> None:
        workers = (self.worker.ranks if self.worker is not None else []) + ([self.spare] if self.spare else [])
        for w in workers:
            w.close()   # SIGTERM ends each from now on; a standby's closed activation pipe ends it too
        procs = [self.scheduler] + [w.proc for w in workers]
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in procs:   # the worker exits by itself after a drain's Shutdown
            try:
                proc.wait(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in procs:
            # Again each second: a worker still starting ignores SIGTERM until its handler is set.
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    proc.terminate()
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def supervise(scheduler_argv: list[str], worker_argv: list[str], *,
              max_worker_restarts: int = 5, drain_seconds: float = 30.0, standby: bool = False,
              tp_size: int = 1) -> int:
    from jitney.scheduler.main import busy_door

    # Before any process starts (the worker's load takes seconds); the
    # scheduler's own bind is the authority, and refuses with status 2 too.
    if (refused := busy_door(scheduler_argv)) is not None:
        print(f"jitney serve: {refused}", file=sys.stderr, flush=True)
        return 2
    remove_stale_socket_dirs()
    with tempfile.TemporaryDirectory(prefix=_socket_dir_prefix(os.getpid())) as tmp:
        addrs = ["--plan-addr", f"ipc://{tmp}/plan", "--result-addr", f"ipc://{tmp}/result"]
        base = [sys.executable, "-m", "jitney.cli"]
        return _Supervisor(base + ["scheduler", *scheduler_argv, *addrs],
                           base + ["worker", *worker_argv, *addrs],
                           max_worker_restarts, drain_seconds, standby, tp_size).run()


def _socket_dir_prefix(pid: int) -> str:
    return f"jitney-{pid}-"


def remove_stale_socket_dirs(pid: int | None = None, *, wait: float = 0.0) -> list[Path]:
    """Remove the ``ipc://`` folders that `jitney serve` processes which are
    gone left behind (one that is SIGKILLed cannot remove its own); only
    ``pid``'s when given. A folder is stale when its supervisor's pid runs no
    process and its plan socket takes no connection: a scheduler whose
    supervisor was killed alone still listens on its own, and so does one in
    another pid namespace that shares this temporary folder. ``wait``: try
    again for up to this many seconds while a folder is not stale yet (the
    processes of a group just killed are still dying). The folders removed."""
    root = Path(tempfile.gettempdir())
    deadline = time.monotonic() + wait
    removed: list[Path] = []
    while True:
        kept = []
        for folder in root.glob(_socket_dir_prefix(pid) + "*" if pid is not None else "jitney-*-*"):
            owner = folder.name.split("-")[1]
            if not owner.isdigit() or int(owner) == os.getpid() or folder.is_symlink() or not folder.is_dir():
                continue
            try:
                if folder.stat().st_uid != os.getuid():
                    continue
                # (The plan socket: the result socket's monitor counts each connection as a worker's.)
                if _running(int(owner)) or _listening(folder / "plan"):
                    kept.append(folder)
                    continue
            except OSError:    # removed meanwhile
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        if not kept or time.monotonic() >= deadline:
            return removed
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's
        pass
    return True


def _listening(path: Path) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            return True     # (EAGAIN: a full backlog; someone listens)
    return True
