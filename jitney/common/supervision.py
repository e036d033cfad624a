"""What `jitney serve`'s supervisor and the workers it starts agree on.

The supervisor hands each worker the write end of a pipe, by number, in
``READY_FD_ENV``; the worker writes one byte to it once its Ready is sent and
closes it. The supervisor's restart policy tells the two kinds of death
apart: a worker that was serving is restarted at once, one that died before
its Ready is a crash loop (backoff, and a limit).
"""


READY_FD_ENV = "JITNEY_READY_FD"

# A standby worker is handed the read end of a second pipe in this variable:
# it loads and warms up, then waits for one byte on it before it connects
# and sends its Ready; the pipe's end (the supervisor gone) makes it exit.
STANDBY_FD_ENV = "JITNEY_STANDBY_FD"
