"""Anthropic's Messages API over the chat path (``OpenAIRoutes.open_chat``):

    POST /v1/messages                 a Message, or (stream: true) its server-sent events
    POST /v1/messages/count_tokens    {"input_tokens": N}: the prompt as the chat path renders it

The request is checked and translated by ``protocol.py``, admitted as a chat
completion (the same validation, queue bounds, deadlines, per-key limits,
metrics and cancellation as every door), and its OpenAI chunks translated back
by ``events.py``. Every error is Anthropic's shape; a stream that fails after its
first event ends with an ``error`` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.anthropic.events import MessageAssembler
from jitney.scheduler.api.http.anthropic.protocol import AnthropicError, MessagesRequest, parse_messages_request
from jitney.scheduler.api.http.encoding import dumps
from jitney.scheduler.api.http.openai.protocol import APIError, parse_request, serving_state
from jitney.scheduler.api.http.openai.routes import OpenAIRoutes
from jitney.scheduler.api.http.sse import HEADERS
from jitney.scheduler.api.servicer import new_seed
from jitney.scheduler.api.validation import validate_generation
from jitney.scheduler.core.request import InvalidRequestError

PATH_PREFIX = "/v1/messages"


class AnthropicRoutes:
    def __init__(self, openai: OpenAIRoutes) -> None:
        self.openai = openai

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self.messages)
        router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            parsed = parse_messages_request(await _body(request))
            run = await self._open(request, parsed)
        except AnthropicError as exc:
            return exc.response()
        try:
            assembler = MessageAssembler(f"msg_{uuid.uuid4().hex[:24]}", parsed.chat["model"], run.prompt_tokens)
            if parsed.stream:
                return await self._stream(request, run, assembler, parsed)
            try:
                async for chunk in run.chunks():
                    assembler.feed(chunk)
            except APIError as exc:
                return _translate(exc, parsed).response()
            return web.json_response(assembler.message(run.stop_sequences.get(0)), dumps=dumps)
        finally:
            run.close()

    async def _open(self, request: web.Request, parsed: MessagesRequest) -> Any:
        try:
            return await self.openai.open_chat(request, parsed.chat, id_prefix="msg", door="anthropic")
        except APIError as exc:
            raise _translate(exc, parsed) from None

    async def _stream(self, request: web.Request, run: Any, assembler: MessageAssembler,
                      parsed: MessagesRequest) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        try:
            try:
                async for chunk in run.chunks():
                    events = assembler.feed(chunk)
                    if response is None:   # headers with the first token: errors before keep their status
                        response = web.StreamResponse(headers=HEADERS)
                        await response.prepare(request)
                    for event in events:
                        await _send(response, event)
                if response is None:
                    response = web.StreamResponse(headers=HEADERS)
                    await response.prepare(request)
                for event in assembler.finish(run.stop_sequences.get(0)):
                    await _send(response, event)
            except APIError as exc:
                error = _translate(exc, parsed)
                if response is None:
                    return error.response()
                await _send(response, error.body())
            await response.write_eof()
        except ConnectionResetError:   # the client went away; the caller cancels the request
            pass
        return response if response is not None else web.Response(status=499)

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            parsed = parse_messages_request(await _body(request), count_only=True)
            state = serving_state(self.openai.servicer)
            names = self.openai.servicer.served_names(state)
            if parsed.chat["model"] not in names and self.openai.servicer.lora.registry.get(parsed.chat["model"]) is None:
                raise AnthropicError(404, f"model: {parsed.chat['model'][:128]} is not served here "
                                     f"(this server serves {', '.join(names)})")
            try:
                chat = parse_request(dict(parsed.chat, max_completion_tokens=1), chat=True)
                validated = validate_generation(chat.params, state.tokenizer, state.limits, new_seed=new_seed,
                                                tool_format=self.openai.servicer.tool_format(state))
            except APIError as exc:
                raise _translate(exc, parsed) from None
            except InvalidRequestError as exc:
                raise AnthropicError(400, str(exc)) from None
        except AnthropicError as exc:
            return exc.response()
        return web.json_response({"input_tokens": len(validated.prompt_token_ids)})


async def _body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AnthropicError(400, f"the request body is not valid JSON: {exc}") from None


def _translate(exc: APIError, parsed: MessagesRequest) -> AnthropicError:
    """The chat path's OpenAI error as Anthropic's, naming this request's field."""
    message = exc.message
    if exc.param is not None:
        mine = parsed.param(exc.param)
        if mine is not None and message.startswith(f"{exc.param}:"):
            message = f"{mine}:{message[len(exc.param) + 1:]}"
        elif mine is not None and mine != exc.param:
            message = f"{mine}: {message}"
    if exc.status == 404 and exc.code == "model_not_found":
        message = f"model: {message}"
    return AnthropicError(exc.status, message)


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode())
