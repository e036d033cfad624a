"""Server-sent events: a streamed response (``text/event-stream``, not
cached nor buffered by a proxy) and its ``data:`` events."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.encoding import dumps

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream() -> web.StreamResponse:
    """A response of server-sent events, not yet prepared (its headers not sent)."""
    return web.StreamResponse(headers=HEADERS)


async def send_json(response: web.StreamResponse, obj: Mapping[str, Any]) -> None:
    """One event: ``data: {obj as JSON}``."""
    await send_data(response, dumps(obj))


async def send_data(response: web.StreamResponse, data: str) -> None:
    """One event: ``data: {data}`` (one line)."""
    await response.write(f"data: {data}\n\n".encode())
