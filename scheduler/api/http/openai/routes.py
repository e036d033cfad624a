"""The OpenAI API's routes over the servicer (shared with gRPC): every
request becomes a ``jitney.v1.GenerationParams`` and goes through the gRPC
path's own ``GenerationServicer.admit`` (validation, the response format's
grammar, ``Engine.submit``, metrics), so limits, queue bounds, deadlines,
cancellation, metrics and the request log are the same.

    GET  /v1/models, /v1/models/{id}    the served model (owned_by "jitney")
    POST /v1/completions                one prompt: text or token ids
    POST /v1/chat/completions           chat messages (text content), tools

``stream: true`` answers server-sent events, ``data: {chunk}`` ... then
``data: [DONE]``. Headers go out with the first generated token, so a
request that fails before any (a deadline while queued, a lost worker) still
gets its HTTP status; an error after that arrives as one
``data: {"error": ...}`` event, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.encoding import dumps
from jitney.scheduler.api.http.middleware import KEY_NAME
from jitney.scheduler.api.http.openai.protocol import (HTTP_STATUS, APIError, ParsedRequest, _timeout,
                                                       openai_param, parse_request, serving_state)
from jitney.scheduler.api.http.openai.lora_routes import LoraRoutes, select_model
from jitney.scheduler.api.http.openai.responses import FINISH_REASONS, _Choice, _Formatter, usage_dict
from jitney.scheduler.api.http.sse import event_stream, send_data, send_json
from jitney.scheduler.api.metrics import RequestRecord
from jitney.scheduler.api.servicer import GenerationServicer, RequestRefused, ServingState
from jitney.scheduler.core.engine import RequestHandle, StreamEvent
from jitney.scheduler.core.request import FinishReason

DONE = "[DONE]"     # the data of a stream's last event


class OpenAIRoutes:
    """The OpenAI API's routes over ``servicer``'s serving state (shared with gRPC)."""

    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer
        self.created = int(time.time())

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.list_models)
        router.add_get("/v1/models/{model:.+}", self.get_model)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat_completions)
        LoraRoutes(self.servicer).add_to(router)

    # -- state ---------------------------------------------------------------
    def _serving(self) -> ServingState:
        return serving_state(self.servicer)

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jitney"}

    # -- routes --------------------------------------------------------------
    def _adapter_entries(self, state: ServingState) -> list[dict[str, Any]]:
        """The LoRA adapters, as vLLM lists them (a ``parent``: the base's first name)."""
        parent = self.servicer.served_names(state)[0]
        return [dict(self._model_entry(a.name), parent=parent, root=a.path)
                for a in self.servicer.lora.registry.adapters()]

    async def list_models(self, request: web.Request) -> web.Response:
        state = self._serving()
        return web.json_response({"object": "list",
                                  "data": [self._model_entry(n) for n in self.servicer.served_names(state)]
                                  + self._adapter_entries(state)})

    async def get_model(self, request: web.Request) -> web.Response:
        state = self._serving()
        name = request.match_info["model"]
        names = self.servicer.served_names(state)
        adapter = next((e for e in self._adapter_entries(state) if e["id"] == name), None)
        if adapter is not None:
            return web.json_response(adapter)
        if name not in names:
            raise _model_not_found(name, names)
        return web.json_response(self._model_entry(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # -- the chat path other doors translate into --------------------------
    async def open_chat(self, request: web.Request, body: dict[str, Any], *,
                        id_prefix: str = "chatcmpl", door: str = "openai") -> ChatRun:
        """Admit ``body`` (a chat completions request, as OpenAI's JSON) as
        ``/v1/chat/completions`` would, streamed with usage: the Anthropic and
        Responses doors build such a body from their own and translate the
        chunks back; ``door`` names the caller's API in the metrics. Refusals raise APIError (OpenAI's shape: the door maps it
        to its own), as do errors while the answer streams."""
        timeout = _timeout(request)
        state = self._serving()
        body = dict(body, stream=True, stream_options={"include_usage": True})
        parsed = parse_request(body, chat=True, defaults=self.servicer.sampling_defaults)
        names = self.servicer.served_names(state)
        select_model(self.servicer, state, body.get("model"), parsed.params)
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        parsed.params.request_id = response_id
        handle, record, prompt_ids = await self._submit(state, parsed, timeout, request.get(KEY_NAME), door)
        fmt = self._formatter(state, parsed, response_id, parsed.params.lora_adapter or names[0], "", prompt_ids)
        return ChatRun(state, handle, record, fmt, len(prompt_ids))

    # -- generation ----------------------------------------------------------
    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        timeout = _timeout(request)
        state = self._serving()
        parsed = parse_request(body, chat=chat, defaults=self.servicer.sampling_defaults)
        names = self.servicer.served_names(state)
        select_model(self.servicer, state, body.get("model"), parsed.params)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        parsed.params.request_id = response_id
        handle, record, prompt_ids = await self._submit(state, parsed, timeout, request.get(KEY_NAME), "openai")
        try:
            echo = _echo_text(parsed, prompt_ids, state.tokenizer) if parsed.echo else ""
            fmt = self._formatter(state, parsed, response_id, parsed.params.lora_adapter or names[0], echo, prompt_ids)
            events = _events(handle, record)
            if parsed.stream:
                return await _stream(request, events, fmt, parsed)
            return await _collect(events, fmt)
        finally:
            # Runs on normal end, on error and when the client disconnects
            # (the handler task is cancelled): frees the blocks at once.
            record.on_error("CANCELLED", "the client went away")   # no-op once ended
            state.engine.cancel(handle)

    def _formatter(self, state: ServingState, parsed: ParsedRequest, response_id: str, model: str,
                   echo: str, prompt_ids: tuple[int, ...]) -> _Formatter:
        """The answer's formatter: tool calls parsed where the request has tools (and a
        tool_choice other than none), reasoning where the model reasons."""
        p = parsed.params
        calls = bool(p.tools) and p.tool_choice != "none"
        return _Formatter(parsed, response_id, model, self.servicer.token_texts(state), echo,
                          tool_format=self.servicer.tool_format(state) if calls else None,
                          reasoning=self.servicer.reasoning_mode(state, p, prompt_ids) if parsed.chat
                          else "off")

    async def _submit(self, state: ServingState, parsed: ParsedRequest, timeout: float | None,
                      key: str | None, door: str) -> tuple[RequestHandle, RequestRecord, tuple[int, ...]]:
        """``GenerationServicer.admit`` (the gRPC path's checks, codes and metrics), its
        refusals as OpenAI errors (an invalid field named by its OpenAI argument)."""
        try:
            handle, record, validated = await self.servicer.admit(state, parsed.params, timeout, key, door,
                                                                  token_logprobs=parsed.logprobs)
        except RequestRefused as refused:
            exc = refused.invalid
            if exc is None:
                raise APIError(HTTP_STATUS[refused.code], refused.message) from None
            param = openai_param(exc.field, parsed)
            detail = str(exc).removeprefix(f"{exc.field}: ")
            raise APIError(400, f"{param}: {detail}", param=param) from None
        return handle, record, validated.prompt_token_ids


class ChatRun:
    """An admitted chat request; ``chunks`` yields its answer as OpenAI
    ``chat.completion.chunk`` dicts, the usage chunk last. ``close`` (always
    call it: in a ``finally``) cancels it if it has not ended, freeing its
    blocks at once."""

    def __init__(self, state: ServingState, handle: RequestHandle, record: RequestRecord,
                 fmt: _Formatter, prompt_tokens: int) -> None:
        self.state, self.handle, self.record, self.fmt = state, handle, record, fmt
        self.id, self.model, self.prompt_tokens = fmt.id, fmt.model, prompt_tokens
        # What OpenAI's finish_reason "stop" does not tell apart: per sample, the
        # engine's own reason and the stop string that matched (Anthropic's stop_sequence).
        self.finish_reasons: dict[int, FinishReason] = {}
        self.stop_sequences: dict[int, str] = {}

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        choices: dict[int, _Choice] = {}
        async for event in _events(self.handle, self.record):
            if event.finish_reason is not None:
                self.finish_reasons[event.sample_index] = event.finish_reason
            if event.stop_sequence is not None:
                self.stop_sequences[event.sample_index] = event.stop_sequence
            c = choices.setdefault(event.sample_index, _Choice(event.sample_index))
            for chunk in self.fmt.chunks(c, event):
                yield chunk
            if event.stream_done:
                yield self.fmt.usage_chunk(usage_dict(event))

    def close(self) -> None:
        self.record.on_error("CANCELLED", "the client went away")   # no-op once ended
        self.state.engine.cancel(self.handle)


def _model_not_found(name: str, names: tuple[str, ...]) -> APIError:
    served = ", ".join(f"`{n}`" for n in names)
    return APIError(404, f"The model `{name[:128]}` does not exist: this server serves {served}",
                    param="model", code="model_not_found")


def _echo_text(parsed: ParsedRequest, prompt_ids: tuple[int, ...], tokenizer: Any) -> str:
    """The prompt as the completion's echo: its own text, or its token ids decoded."""
    if parsed.params.WhichOneof("prompt") == "text":
        return parsed.params.text
    return str(tokenizer.decode(list(prompt_ids)))


async def _events(handle: RequestHandle, record: RequestRecord) -> AsyncIterator[StreamEvent]:
    """The request's events, recorded; an error event raises APIError."""
    async for event in handle.stream():
        if event.error is not None:
            record.on_error(event.error_code, event.error)
            raise APIError(HTTP_STATUS.get(event.error_code, 500), event.error)
        record.on_tokens(len(event.token_ids))
        if event.stream_done:
            reason = event.finish_reason.value if event.finish_reason is not None else "stop"
            record.on_finish(reason)
        yield event


async def _collect(events: AsyncIterator[StreamEvent], fmt: _Formatter) -> web.Response:
    choices: dict[int, _Choice] = {}
    usage = None
    async for event in events:
        c = choices.setdefault(event.sample_index, _Choice(event.sample_index))
        c.text += event.text
        c.token_ids.extend(event.token_ids)
        c.logprobs.extend(event.logprobs)
        c.top.extend(event.top_logprobs)
        if event.finish_reason is not None:
            c.finish_reason = FINISH_REASONS.get(event.finish_reason, "stop")
        if event.stream_done:
            usage = usage_dict(event)
    body = fmt.full([choices[i] for i in sorted(choices)], usage)
    return web.json_response(body, dumps=dumps)


async def _stream(request: web.Request, events: AsyncIterator[StreamEvent], fmt: _Formatter,
                  parsed: ParsedRequest) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    choices: dict[int, _Choice] = {}
    try:
        try:
            async for event in events:
                if response is None:    # headers with the first token: errors before keep their status
                    response = event_stream()
                    await response.prepare(request)
                c = choices.setdefault(event.sample_index, _Choice(event.sample_index))
                for chunk in fmt.chunks(c, event):
                    await send_json(response, chunk)
                if event.stream_done and parsed.include_usage:
                    await send_json(response, fmt.usage_chunk(usage_dict(event)))
        except APIError as exc:
            if response is None:
                return exc.response()
            await send_json(response, exc.body())
        if response is None:      # cannot happen: a stream ends with its last event
            raise APIError(500, "the request ended without an answer")
        await send_data(response, DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client went away; the caller cancels the request
        pass
    return response if response is not None else web.Response(status=499)
