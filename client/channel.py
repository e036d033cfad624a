"""Channels to a Jitney server: plaintext or TLS (mutual TLS with a client
certificate), and the API key that every call carries.

    open_channel("host:50051", tls=TlsFiles(ca="ca.pem"), api_key=api_key_from(None))

One helper for `jitney generate`, `jitney health`, `jitney bench` and
``JitneyClient``. The key travels as gRPC metadata ``authorization: Bearer
KEY`` (added by a client interceptor, so it works over plaintext too: behind
a TLS-terminating proxy or on loopback).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

API_KEY_ENV = "JITNEY_API_KEY"


@dataclass(frozen=True)
class TlsFiles:
    """TLS to the server. ``ca``: PEM roots that verify the server (None: the
    system's); ``cert`` + ``key``: a client certificate, for mutual TLS."""

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises ValueError (a flag without its pair) or OSError (a file unread)."""
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key: give --tls-cert and --tls-key together")
        read = (lambda path: Path(path).read_bytes() if path is not None else None)
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key), certificate_chain=read(self.cert))


def api_key_from(flag: str | None) -> str | None:
    """The ``--api-key`` flag, else ``$JITNEY_API_KEY``, else None."""
    return flag if flag else os.environ.get(API_KEY_ENV) or None


def open_channel(target: str, *, tls: TlsFiles | None = None, api_key: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel: plaintext without ``tls``; with ``api_key``, every call
    carries ``authorization: Bearer KEY`` (also over plaintext: a key there is
    only as safe as the network)."""
    channel = (grpc.secure_channel(target, tls.credentials(), options=list(options)) if tls is not None
               else grpc.insecure_channel(target, options=list(options)))
    return grpc.intercept_channel(channel, _BearerKey(api_key)) if api_key else channel


def open_aio_channel(target: str, *, tls: TlsFiles | None = None, api_key: str | None = None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """``open_channel`` for asyncio."""
    # grpc.aio files each interceptor under one kind only: one object per kind.
    interceptors: list[Any] | None = ([_AioUnaryBearerKey(api_key), _AioStreamBearerKey(api_key)]
                                      if api_key else None)
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=list(options),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)


def _bearer(api_key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {api_key}")


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the key to every call of a blocking channel."""

    def __init__(self, api_key: str) -> None:
        self._entry = _bearer(api_key)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, [*(details.metadata or ()), self._entry])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioBearerKey:
    """Adds the key to the calls of an asyncio channel (jitney.v1's calls are all
    unary-request: unary-unary and unary-stream)."""

    def __init__(self, api_key: str) -> None:
        self._entry = _bearer(api_key)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()), self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _AioUnaryBearerKey(_AioBearerKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamBearerKey(_AioBearerKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)
