"""Who may talk to the scheduler's doors: TLS and API keys (flags, loading).

    flag                          what it turns on
    --tls-cert F --tls-key F      TLS on the gRPC port and the OpenAI door
    --tls-client-ca F             ... and clients must show a certificate
                                  signed by this CA (mutual TLS)
    --api-key-file F              every jitney.v1 call and every OpenAI route
                                  but /health needs `authorization: Bearer KEY`
    --max-requests-per-key N      a key's generation requests in flight

Open without a key, on the same port and credentials: the standard health
service (probes) and server reflection (it reveals only the public schema).
Everything is read once, at start-up: rotating a certificate or a key is a
restart (`jitney serve` drains on SIGTERM).

The key file holds one key a line, ``KEY``, ``NAME:KEY`` or
``NAME:KEY:WEIGHT``; blank lines and ``# comments`` are skipped; a key
without a name is called ``key-LINE``. A key is printable ASCII without
spaces (a key holding ``:`` needs a name). WEIGHT is the key's tenant weight
under ``--fairness tenant`` (a number in (0, 1000], default 1): after a
name, a last ``:`` field that looks like a number is the weight (a bad one
is an error), any other is part of the key as before; so a key that itself
ends in ``:`` and digits is written with its weight, ``NAME:KEY:1``. Keys
are kept only as SHA-256 digests and never printed: errors name the line.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from jitney.common.arg_types import positive_int
from jitney.common.ports import bind_problem
from jitney.common.tenant_weights import looks_like_weight, parse_weight

SHORT_KEY = 16                        # warn below this many characters
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEY = re.compile(r"[!-~]+")           # printable ASCII, no spaces


class SecurityError(Exception):
    """A TLS or API-key setting that cannot be used (the message says why)."""


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "security", "TLS and API keys, on the gRPC port and the OpenAI door alike. The gRPC "
        "health service and server reflection stay open (no key) for probes and tools. "
        "Files are read once at start: to rotate a certificate or key, restart.")
    g.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="serve TLS with this PEM certificate chain (with --tls-key; default: plaintext)")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="require client certificates signed by this PEM CA (mutual TLS; needs --tls-cert)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="require `authorization: Bearer KEY` (gRPC metadata or HTTP header); one key a "
                        "line, KEY, NAME:KEY or NAME:KEY:WEIGHT (the tenant weight of --fairness tenant), "
                        "'#' comments; logs and metrics name the key, never show it")
    g.add_argument("--max-requests-per-key", type=positive_int, default=None, metavar="N",
                   help="most generation requests in flight per API key; beyond: RESOURCE_EXHAUSTED "
                        "(HTTP 429) (default: unlimited; needs --api-key-file)")


def security_fields(ns: argparse.Namespace) -> dict[str, Any]:
    """The SchedulerProcessConfig fields of the flags above."""
    names = ("tls_cert", "tls_key", "tls_client_ca", "api_key_file", "max_requests_per_key")
    return {name: getattr(ns, name) for name in names}


def check_flags(tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None,
                api_key_file: str | None, max_requests_per_key: int | None) -> None:
    """Raise SecurityError for flags that do not go together."""
    if (tls_cert is None) != (tls_key is None):
        raise SecurityError("--tls-cert and --tls-key go together: give both or neither")
    if tls_client_ca is not None and tls_cert is None:
        raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    if max_requests_per_key is not None and api_key_file is None:
        raise SecurityError("--max-requests-per-key needs --api-key-file")


# -- TLS ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTls:
    """A checked certificate chain and key, and the client CA of mutual TLS:
    their PEM bytes (for gRPC) and files (for the HTTP door's ssl module)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same credentials for the HTTP door. Raises SecurityError."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ValueError) as exc:       # ssl.SSLError is an OSError
            raise SecurityError(f"--tls-cert {self.cert_file} / --tls-key {self.key_file}: not a "
                                f"PEM certificate chain and the private key that matches it ({exc})") from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(self.client_ca_file)
            except (OSError, ValueError) as exc:
                raise SecurityError(f"--tls-client-ca {self.client_ca_file}: not PEM CA "
                                    f"certificates ({exc})") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def load_server_tls(cert: str, key: str, client_ca: str | None) -> ServerTls:
    tls = ServerTls(cert, key, client_ca, _read(cert, "--tls-cert"), _read(key, "--tls-key"),
                    _read(client_ca, "--tls-client-ca") if client_ca is not None else None)
    tls.ssl_context()       # the pair and the CA are checked here, not at the first handshake
    return tls


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise SecurityError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


# -- API keys -----------------------------------------------------------------------


class ApiKeys:
    """Names of the keys of ``--api-key-file``, looked up in constant time."""

    def __init__(self, named: list[tuple[str, bytes]], weights: dict[str, float] | None = None) -> None:
        self._digests = [(name, hashlib.sha256(key).digest()) for name, key in named]
        self.names = [name for name, _ in named]
        self.weights = dict(weights or {})    # name -> tenant weight (NAME:KEY:WEIGHT lines)

    def identify(self, token: str | None) -> str | None:
        """The name of the key ``token``, or None. Compares the SHA-256 digests
        (equal length) with every key, never stopping at a match, so the time
        says nothing about which keys exist."""
        if token is None:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for name, known in self._digests:
            if hmac.compare_digest(digest, known):
                found = name
        return found


def parse_api_keys(text: str, source: str = "--api-key-file") -> tuple[ApiKeys, list[str]]:
    """Parse a key file: the keys and warnings (short keys). Raises SecurityError
    naming the line, never showing a key."""
    named: list[tuple[str, bytes]] = []
    weights: dict[str, float] = {}
    names: dict[str, int] = {}
    lines_of_key: dict[bytes, int] = {}
    warnings = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        if not sep:
            name, key = f"key-{number}", line
        name, key = name.strip(), key.strip()
        where = f"{source} line {number}"
        head, colon, tail = key.rpartition(":")
        if sep and colon and looks_like_weight(tail):
            try:
                weights[name] = parse_weight(tail)
            except ValueError as exc:
                raise SecurityError(f"{where}: key {name!r}: {exc}") from None
            key = head.strip()
        if not _NAME.fullmatch(name):
            raise SecurityError(f"{where}: a key name is 1-64 letters, digits, '_', '-' or '.'")
        if not key:
            raise SecurityError(f"{where}: key {name!r} is empty")
        if not _KEY.fullmatch(key):
            raise SecurityError(f"{where}: a key is printable ASCII without spaces")
        if name in names:
            raise SecurityError(f"{where}: the name {name!r} is already used on line {names[name]}")
        data = key.encode("ascii")
        if data in lines_of_key:
            raise SecurityError(f"{where}: the same key as line {lines_of_key[data]}")
        if len(key) < SHORT_KEY:
            warnings.append(f"API key {name!r} ({where}) has {len(key)} characters: "
                            f"shorter than {SHORT_KEY}, it is easy to guess")
        names[name], lines_of_key[data] = number, number
        named.append((name, data))
    if not named:
        raise SecurityError(f"{source}: no keys in the file (one KEY or NAME:KEY a line)")
    return ApiKeys(named, weights), warnings


def load_api_keys(path: str) -> tuple[ApiKeys, list[str]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SecurityError(f"--api-key-file {path}: cannot read it: {reason or exc}") from None
    return parse_api_keys(text, f"--api-key-file {path}")


# -- all of it --------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSecurity:
    tls: ServerTls | None = None
    keys: ApiKeys | None = None
    max_requests_per_key: int | None = None


def load_security(tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None,
                  api_key_file: str | None, max_requests_per_key: int | None
                  ) -> tuple[ServerSecurity, list[str]]:
    """Check and read every security flag; the settings and warnings to print.
    Raises SecurityError."""
    check_flags(tls_cert, tls_key, tls_client_ca, api_key_file, max_requests_per_key)
    tls = load_server_tls(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None
    keys, warnings = load_api_keys(api_key_file) if api_key_file is not None else (None, [])
    return ServerSecurity(tls, keys, max_requests_per_key), warnings


def listen_grpc(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity) -> object | None:
    """Bind a gRPC server's port, with TLS when ``security`` has it; why it
    cannot be bound (None: bound). Asked first (``jitney.common.ports``):
    gRPC binds every address the host resolves to and only warns when some
    fail, so a port half in use is refused too."""
    if (problem := bind_problem(host, port)) is not None:
        return problem.strerror or problem
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, security.tls.grpc_credentials()) if security.tls
                 else server.add_insecure_port(address))
    except RuntimeError as exc:     # grpcio raises where older versions returned 0
        return exc
    return None if bound else "the bind failed"


def exposure_warning(host: str, security: ServerSecurity) -> str | None:
    """A warning when a non-loopback address is served without TLS."""
    if security.tls is not None or _is_loopback(host):
        return None
    what = "API keys, prompts and outputs" if security.keys is not None else "prompts and outputs"
    return (f"--host {host} is not a loopback address and TLS is off: {what} cross the "
            "network in clear text (give --tls-cert and --tls-key)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False         # a name or a wildcard (0.0.0.0, ::): assume the network
