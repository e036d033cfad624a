"""Security of the scheduler <-> worker ZeroMQ link: CurveZMQ keys and where they are required.

The scheduler binds both sockets and is the Curve *server*; the worker connects
and is a Curve *client*. Curve encrypts every frame and authenticates both
ends: the worker knows the scheduler's public key, and the scheduler admits
only the worker public keys it is told to trust (a ZAP allow-list, checked in
a thread of the scheduler's ZeroMQ context). A peer without a trusted key never
completes the handshake, so it can neither read a plan nor deliver a frame.

Key folder (``jitney keys --out DIR``; zmq.auth's certificate format):

    file                holds                          read by
    server.key          the scheduler's public key     the worker
    server.key_secret   the scheduler's key pair       the scheduler   (mode 0600)
    worker.key          the worker's public key        the scheduler (trusts it)
    worker.key_secret   the worker's key pair          the worker      (mode 0600)

Each side reads only its own files, so one folder serves both, or it is split
(``jitney keys --split``: DIR/scheduler holds server.key_secret and
worker.key, DIR/worker holds worker.key_secret and server.key). The scheduler
trusts every ``*.key`` in its folder except ``server.key``, so several worker
keys can be trusted at once (rotation). A secret file readable by group or
others is refused.

Which endpoints need keys (``check_endpoint``):

    endpoint                without --curve-keys
    tcp:// (any network)    refused, unless --insecure-plaintext-zmq
    ipc://                  allowed if its folder is the user's own, mode 0700
                            (else refused, unless --insecure-plaintext-zmq)
    inproc://               allowed (one process)
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("jitney.zmq_security")

ENV_CURVE_KEYS = "JITNEY_CURVE_KEYS"
SERVER_PUBLIC, SERVER_SECRET = "server.key", "server.key_secret"
WORKER_PUBLIC, WORKER_SECRET = "worker.key", "worker.key_secret"
LOCAL_TRANSPORTS = ("ipc", "inproc")
HOW_TO_GET_KEYS = ("generate keys with `jitney keys --out DIR` and give DIR to both the scheduler "
                   f"and the worker (--curve-keys DIR or {ENV_CURVE_KEYS}=DIR)")


class LinkSecurityError(RuntimeError):
    """The link's keys or endpoints are unsafe or unusable; the process must not start."""


@dataclass(frozen=True)
class ServerKeys:
    """The scheduler's Curve key pair and the worker public keys it admits (z85, 40 bytes each)."""

    public: bytes
    secret: bytes
    trusted_workers: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """The worker's Curve key pair and the scheduler's public key (z85, 40 bytes each)."""

    public: bytes
    secret: bytes
    server_public: bytes


# -- flags -------------------------------------------------------------------

def add_link_security_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--curve-keys`` and ``--insecure-plaintext-zmq`` (dest ``curve_keys``,
    ``insecure_plaintext_zmq``), for the scheduler and the worker alike."""
    parser.add_argument("--curve-keys", dest="curve_keys", metavar="DIR",
                        default=os.environ.get(ENV_CURVE_KEYS) or None,
                        help="folder of CurveZMQ keys for the scheduler<->worker link, from "
                             f"`jitney keys --out DIR` (default: ${ENV_CURVE_KEYS}); required when "
                             "an endpoint is tcp://")
    parser.add_argument("--insecure-plaintext-zmq", dest="insecure_plaintext_zmq", action="store_true",
                        help="allow the link over tcp:// (or an ipc:// folder others can enter) "
                             "without keys: unauthenticated and unencrypted")


# -- loading keys --------------------------------------------------------------

def load_server_keys(folder: str | os.PathLike[str]) -> ServerKeys:
    """The scheduler's keys from ``folder``: server.key_secret and every other ``*.key``."""
    root = Path(folder)
    public, secret = _read_secret(root / SERVER_SECRET)
    trusted = frozenset(_read_public(p) for p in sorted(root.glob("*.key")) if p.name != SERVER_PUBLIC)
    if not trusted:
        raise LinkSecurityError(f"no worker public key ({WORKER_PUBLIC}) in {root}: the scheduler "
                                f"would admit no worker; {HOW_TO_GET_KEYS}")
    return ServerKeys(public, secret, trusted)


def load_client_keys(folder: str | os.PathLike[str]) -> ClientKeys:
    """The worker's keys from ``folder``: worker.key_secret and server.key."""
    root = Path(folder)
    public, secret = _read_secret(root / WORKER_SECRET)
    return ClientKeys(public, secret, _read_public(root / SERVER_PUBLIC))


def _read_secret(path: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise LinkSecurityError(f"missing Curve secret key file {path}; {HOW_TO_GET_KEYS}")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise LinkSecurityError(f"{path} is accessible by group or others (mode {mode:04o}): "
                                f"refusing to use a secret key others can read; `chmod 600 {path}` "
                                "(or generate a new set, since it may have leaked)")
    public, secret = _read_certificate(path)
    if secret is None:
        raise LinkSecurityError(f"{path} holds no secret-key")
    if zmq.curve_public(secret) != public:
        raise LinkSecurityError(f"{path}: its public-key does not belong to its secret-key")
    return public, secret


def _read_public(path: Path) -> bytes:
    if not path.is_file():
        raise LinkSecurityError(f"missing Curve public key file {path}; {HOW_TO_GET_KEYS}")
    return _read_certificate(path)[0]


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise LinkSecurityError(f"cannot read Curve certificate {path}: {exc}") from None
    for name, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and len(key) != 40:
            raise LinkSecurityError(f"{path}: {name} is not a 40-character Z85 Curve key")
    return public, secret


# -- generating keys ------------------------------------------------------------

def generate_keys(out: str | os.PathLike[str], *, split: bool = False,
                  if_missing: bool = False) -> list[Path]:
    """Write a fresh set into ``out`` (mode 0700; secrets 0600) and return the files written.

    ``split``: the scheduler's files in ``out/scheduler``, the worker's in
    ``out/worker``. Existing keys are never overwritten: with ``if_missing`` a
    complete set is kept (nothing written), otherwise any existing file is an error.
    """
    root = Path(out)
    dirs = {"scheduler": root / "scheduler", "worker": root / "worker"} if split else \
        {"scheduler": root, "worker": root}
    targets = {
        "server": (dirs["scheduler"] / SERVER_SECRET, dirs["worker"] / SERVER_PUBLIC),
        "worker": (dirs["worker"] / WORKER_SECRET, dirs["scheduler"] / WORKER_PUBLIC),
    }
    paths = [p for pair in targets.values() for p in pair]
    existing = [p for p in paths if p.exists()]
    if existing:
        if if_missing and len(existing) == len(paths):
            return []
        raise LinkSecurityError(f"keys already exist ({', '.join(map(str, existing))}); refusing to "
                                "overwrite them: remove them first, or use another folder")
    for folder in {root, *dirs.values()}:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)    # also when it existed (a volume's mount point)
    for name, (secret_path, public_path) in targets.items():
        public, secret = zmq.curve_keypair()
        _write_certificate(secret_path, f"{name} key pair: keep it secret", public, secret)
        _write_certificate(public_path, f"{name} public key", public, None)
    return paths


def _write_certificate(path: Path, what: str, public: bytes, secret: bytes | None) -> None:
    lines = [f"#   Jitney CurveZMQ {what} (zmq.auth certificate format)",
             f"#   generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC by `jitney keys`",
             "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    # Created with its final mode, so a secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret is not None else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


# -- which endpoints need keys ------------------------------------------------------

def check_endpoint(endpoint: str, *, have_keys: bool, insecure_plaintext: bool) -> None:
    """Raise LinkSecurityError when ``endpoint`` may not carry the link as configured."""
    if have_keys:
        return
    scheme = endpoint.split("://", 1)[0]
    if scheme not in LOCAL_TRANSPORTS:
        if insecure_plaintext:
            return
        raise LinkSecurityError(
            f"{endpoint} would carry the scheduler<->worker link over the network without "
            f"authentication or encryption; {HOW_TO_GET_KEYS}, or pass --insecure-plaintext-zmq "
            "to both (only on a network you trust)")
    if scheme == "ipc" and not insecure_plaintext:
        _check_ipc_folder(endpoint)


def _prepare(endpoint: str, have_keys: bool, insecure_plaintext: bool) -> None:
    check_endpoint(endpoint, have_keys=have_keys, insecure_plaintext=insecure_plaintext)
    if not have_keys and endpoint.split("://", 1)[0] not in LOCAL_TRANSPORTS:
        log.warning("the link on %s is unauthenticated and unencrypted (--insecure-plaintext-zmq): "
                    "anyone who reaches it can read prompts and forge results", endpoint)


def _check_ipc_folder(endpoint: str) -> None:
    # Without keys an ipc:// socket is guarded only by file permissions: its folder
    # must be one that no one but this user can enter.
    path = endpoint[len("ipc://"):]
    if path.startswith("@"):
        raise LinkSecurityError(f"{endpoint} is an abstract socket, which any local user can reach; "
                                f"use a path in a private (0700) folder, or {HOW_TO_GET_KEYS}")
    folder = Path(path).absolute().parent
    try:
        st = folder.stat()
    except FileNotFoundError:
        return    # ZeroMQ reports it when it binds or connects
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode & 0o077:
        raise LinkSecurityError(
            f"the folder of {endpoint} ({folder}, mode {mode:04o}, owner uid {st.st_uid}) is not "
            "private: other local users could connect to the link, read prompts and forge results. "
            f"Use a folder of your own with mode 0700 (`chmod 700 {folder}`), or {HOW_TO_GET_KEYS}, "
            "or pass --insecure-plaintext-zmq")


# -- the scheduler's side: Curve server + allow-list --------------------------------

class LinkServer:
    """The scheduler's link security: call ``prepare(sock, endpoint)`` before each bind,
    ``close()`` after the sockets are closed and before the context is terminated.

    With keys, a ZAP authenticator runs in a thread of ``context`` and admits
    only the trusted worker keys. It starts here, before any socket binds: a
    Curve server with no ZAP handler would admit any client key.
    """

    def __init__(self, context: zmq.Context, keys: ServerKeys | None,  # type: ignore[type-arg]
                 *, insecure_plaintext: bool = False) -> None:
        self.keys = keys
        self.insecure_plaintext = insecure_plaintext
        self._auth: ThreadAuthenticator | None = None
        if keys is not None:
            self._auth = ThreadAuthenticator(context, log=log)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowList(keys.trusted_workers))

    def prepare(self, sock: zmq.Socket, endpoint: str) -> None:  # type: ignore[type-arg]
        _prepare(endpoint, self.keys is not None, self.insecure_plaintext)
        if self.keys is not None:
            sock.curve_server = True
            sock.curve_publickey = self.keys.public
            sock.curve_secretkey = self.keys.secret

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class _AllowList:
    """ZAP credentials provider: a client key is admitted iff it is trusted."""

    MAX_REMEMBERED = 1024

    def __init__(self, trusted: frozenset[bytes]) -> None:
        self.trusted = trusted
        self.refused: set[bytes] = set()    # logged once each

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.trusted:
            return True
        if key not in self.refused and len(self.refused) < self.MAX_REMEMBERED:
            self.refused.add(key)
            log.warning("refused a ZeroMQ peer with an untrusted Curve key %s", key.decode())
        return False


# -- the worker's side: Curve client ---------------------------------------------------

def client_side(sock: zmq.Socket, endpoint: str, keys: ClientKeys | None,  # type: ignore[type-arg]
                *, insecure_plaintext: bool = False) -> None:
    """The worker's link security for one socket: call it before ``connect``.

    With keys, a daemon thread logs failed handshakes (an untrusted worker key,
    a wrong server key), which would otherwise look like a scheduler that never
    answers; it ends when the socket's context is terminated.
    """
    _prepare(endpoint, keys is not None, insecure_plaintext)
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_MONITOR_STOPPED)
    address = f"inproc://jitney-handshakes-{id(sock):x}"
    sock.monitor(address, events)
    # A plain socket whatever the context's kind (an asyncio one needs a loop in its thread).
    monitor = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
    monitor.connect(address)
    threading.Thread(target=_log_handshakes, args=(monitor, endpoint), daemon=True,
                     name=f"zmq-handshakes {endpoint}").start()


def _log_handshakes(monitor: zmq.Socket, endpoint: str) -> None:  # type: ignore[type-arg]
    """Log a handshake failure once per change of state (ZeroMQ retries every 100 ms)."""
    last = 0
    try:
        while True:
            event = int(recv_monitor_message(monitor)["event"])
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event == last:
                continue
            last = event
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                log.info("Curve handshake with %s succeeded", endpoint)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                log.error("the scheduler at %s refused this worker's Curve key: is this worker's "
                          "%s in the scheduler's key folder?", endpoint, WORKER_PUBLIC)
            else:
                log.error("Curve handshake with %s failed: is %s the scheduler's public key, does the "
                          "scheduler run with --curve-keys, and is it a Jitney scheduler of this version?",
                          endpoint, SERVER_PUBLIC)
    except zmq.ContextTerminated:
        pass
    finally:
        monitor.close(0)
