"""The HTTP door of the scheduler process (``--openai-port``): the aiohttp
application and its server.

An aiohttp server in the scheduler's own asyncio loop, beside the gRPC
server, over the same Engine and the same ``GenerationServicer`` (its
serving state, shared with gRPC). The application holds a protocol's routes
(OpenAI's: ``http/openai/routes.py``; vLLM's /tokenize, /detokenize and
/version: ``http/openai/utility.py``; Anthropic's Messages API:
``http/anthropic/``; OpenAI's Responses API: ``http/openai_responses/``) and
one of its own:

    GET  /health                        200 while serving, else 503

behind the middleware of ``middleware.py`` (every error as JSON; with
``--api-key-file``, the API keys on every route but ``/health``). A request
body is at most MAX_BODY_BYTES (else 413). With ``--tls-cert`` the door
speaks HTTPS with the gRPC port's certificate (and client CA).
"""

from __future__ import annotations

import ssl

from aiohttp import web

from jitney.scheduler.api.http.anthropic.routes import AnthropicRoutes
from jitney.scheduler.api.http.middleware import _authenticate, _json_errors
from jitney.scheduler.api.http.openai.protocol import serving_state
from jitney.scheduler.api.http.openai.routes import OpenAIRoutes
from jitney.scheduler.api.http.openai.utility import UtilityRoutes
from jitney.scheduler.api.http.openai_responses.routes import ResponsesRoutes
from jitney.scheduler.api.http.openai_responses.store import StoreConfig
from jitney.scheduler.api.servicer import GenerationServicer
from jitney.scheduler.security.tls import ApiKeys

MAX_BODY_BYTES = 16 * 1024 * 1024          # as the gRPC port's message limit


class OpenAIServer:
    """The HTTP door over ``servicer``'s serving state (shared with gRPC);
    with ``keys``, every route but /health needs one of them."""

    def __init__(self, servicer: GenerationServicer, keys: ApiKeys | None = None,
                 responses_store: StoreConfig | None = None) -> None:
        self.servicer = servicer
        self._runner: web.AppRunner | None = None
        middlewares = [_json_errors] + ([_authenticate(keys, servicer.metrics)] if keys is not None else [])
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        self.openai = OpenAIRoutes(servicer)
        self.openai.add_to(self.app.router)
        UtilityRoutes(servicer).add_to(self.app.router)
        AnthropicRoutes(self.openai).add_to(self.app.router)       # /v1/messages
        ResponsesRoutes(self.openai, responses_store).add_to(self.app)   # /v1/responses; None: no store
        self.app.router.add_get("/health", self.health)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: any free port), HTTPS with ``ssl_context``;
        the port bound. Raises OSError."""
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose ``finally`` cancels the request (as a gRPC cancel does).
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        serving_state(self.servicer)
        return web.json_response({"status": "serving"})
