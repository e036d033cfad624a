"""What `jitney serve`'s supervisor and the workers it starts agree on.

The supervisor hands each worker the write end of a pipe, by number, in
``READY_FD_ENV``; the worker writes one byte to it once its Ready is sent and
closes it. The supervisor's restart policy tells the kinds of death apart: a
worker that was serving is restarted at once, one that died before its Ready
is a crash loop (backoff, and a limit), and one that refused its model
(``REFUSED_EXIT_CODE``) ends `jitney serve` at once.
"""

import select

READY_FD_ENV = "JITNEY_READY_FD"

# A worker that no code path can run its model on (an unsupported architecture:
# the worker's UnsupportedModelError) exits with this status, after writing
# REFUSED_BYTE and the reason (UTF-8, one write) to its ready pipe instead of the
# ready byte. Restarting it cannot help: the supervisor stops at once (exit 2).
# (78: sysexits' EX_CONFIG.)
REFUSED_EXIT_CODE = 78
READY_BYTE = b"r"
REFUSED_BYTE = b"u"
# One write of at most PIPE_BUF bytes is atomic: the supervisor reads the reason whole.
MAX_REFUSAL_BYTES = 4000

# A standby worker is handed the read end of a second pipe in this variable:
# it loads and warms up, then waits for one byte on it before it connects
# and sends its Ready; the pipe's end (the supervisor gone) makes it exit.
STANDBY_FD_ENV = "JITNEY_STANDBY_FD"

# Every worker the supervisor starts (the serving one, the standby, each
# tensor-parallel rank) is handed the read end of a third pipe here, on
# which nothing is ever written. Its presence says "supervised": a SIGTERM
# to the whole process group (systemd's stop, `timeout`, `kill -- -PGID`)
# must not end the worker while the scheduler drains, so the worker ignores
# SIGTERM and exits on the scheduler's Shutdown instead. Once this pipe has
# ended (the supervisor closed it to let the worker go, or died), SIGTERM
# ends the worker again. The supervisor also starts each worker with
# SIGTERM blocked (the signal mask survives exec), so one that arrives
# before the worker's handler is set waits for that handler instead of
# ending it: a supervised worker must unblock SIGTERM once its handler is set.
SUPERVISOR_FD_ENV = "JITNEY_SUPERVISOR_FD"


def pipe_ended(fd: int) -> bool:
    """Whether the write end of the pipe whose read end is ``fd`` is closed
    everywhere (nothing is ever written to it: readable means ended)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))      # POLLHUP (or POLLIN: a byte nobody should send) once it has
