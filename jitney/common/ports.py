"""Whether a TCP port can be listened on, the way Jitney's doors listen.

gRPC sets SO_REUSEPORT on its listening sockets unless told not to, and two
sockets that both set it share a port: a second server on a port in use
starts, and the kernel splits the clients between the two. Jitney's doors
(gRPC with ``grpc.so_reuseport`` 0, aiohttp, the metrics server) set only
SO_REUSEADDR, which on Linux lets a port in TIME_WAIT be bound again but
never one that a socket listens on. ``bind_problem`` binds the same way, so
it fails exactly where a door's own bind would: `jitney serve` asks before
it starts any process, and the scheduler asks again just before its gRPC
bind, for the addresses gRPC would skip with only a warning (of
``localhost``'s 127.0.0.1 and ::1, one in use).
"""

from __future__ import annotations

import socket


def bind_problem(host: str, port: int) -> OSError | None:
    """The error of binding ``host:port`` now, for the first of the addresses
    ``host`` resolves to that cannot be bound; None when all can (or ``host``
    does not resolve: the server's own bind then says so)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return exc
    return None
