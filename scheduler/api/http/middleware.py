"""The HTTP door's middleware: every error in the door's JSON shape (OpenAI's;
Anthropic's under ANTHROPIC_PREFIX), and the API keys (``Authorization: Bearer
KEY``, or Anthropic's ``x-api-key: KEY``, on every path but OPEN_PATHS)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.encoding import dumps
from jitney.scheduler.api.http.openai.protocol import APIError
from jitney.scheduler.api.metrics import Metrics, request_log
from jitney.scheduler.security.keys import bearer_token
from jitney.scheduler.security.tls import ApiKeys

log = logging.getLogger("jitney.scheduler")

# Where _authenticate leaves the key's name in a request (aiohttp < 3.12 has no RequestKey).
KEY_NAME: Any = (web.RequestKey("jitney_api_key_name", str) if hasattr(web, "RequestKey")
                 else "jitney_api_key_name")
OPEN_PATHS = frozenset({"/health"})
ANTHROPIC_PREFIX = "/v1/messages"     # Anthropic's Messages API: its own error shape
RESPONSES_PREFIX = "/v1/responses"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def door_of(path: str) -> str:
    """The metrics' ``door`` of an HTTP path."""
    if _under(path, ANTHROPIC_PREFIX):
        return "anthropic"
    return "responses" if _under(path, RESPONSES_PREFIX) else "openai"


def _error_response(request: web.Request, error: APIError, headers: dict[str, str] | None = None) -> web.Response:
    if _under(request.path, ANTHROPIC_PREFIX):
        from jitney.scheduler.api.http.anthropic.protocol import AnthropicError

        return web.json_response(AnthropicError(error.status, error.message).body(), status=error.status,
                                 dumps=dumps, headers=headers)
    return web.json_response(error.body(), status=error.status, dumps=dumps, headers=headers)


def _authenticate(keys: ApiKeys, metrics: Metrics) -> Any:
    """A middleware: ``Authorization: Bearer KEY`` or 401 in OpenAI's shape
    (one answer for a missing and a wrong key); the key's name in ``request[KEY_NAME]``."""

    @web.middleware
    async def authenticate(request: web.Request,
                           handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)   # type: ignore[no-any-return]
        sent = request.headers.get("Authorization")
        token = bearer_token(sent) if sent is not None else request.headers.get("x-api-key")
        sent = sent if sent is not None else token
        name = keys.identify(token)
        if name is None:
            metrics.failure("UNAUTHENTICATED", door=door_of(request.path))
            request_log.info("HTTP %s %s from %s: rejected 401 (%s)", request.method, request.path,
                             request.remote, "no key" if sent is None else "a key that matches none")
            error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` "
                             "(or `x-api-key: KEY`) with a key of this server", code="invalid_api_key")
            return _error_response(request, error, {"WWW-Authenticate": 'Bearer realm="jitney"'})
        request[KEY_NAME] = name
        return await handler(request)   # type: ignore[no-any-return]
    return authenticate


@web.middleware
async def _json_errors(request: web.Request,
                       handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Every error in OpenAI's JSON shape (aiohttp's own 404, 405, 413 too)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except APIError as exc:
        return _error_response(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(request, APIError(exc.status, exc.text or exc.reason))
    except Exception:
        log.exception("the HTTP API failed on %s %s", request.method, request.path)
        return _error_response(request, APIError(500, "internal error"))
