"""The OpenAI Responses API's routes, a translator over the chat path:

    POST   /v1/responses          create (``stream: true``: typed server-sent events)
    GET    /v1/responses/{id}     a stored response (404 when unknown, aged out or not stored)
    GET    /v1/responses/{id}/input_items
                                  the items the response was generated from, paged
                                  (``after``, ``limit`` 1..100 (20), ``order`` asc|desc (desc)):
                                  the conversation of its ``previous_response_id`` chain
                                  and its own input, everything the model was given
    DELETE /v1/responses/{id}     delete a stored response

A create request becomes a chat completions body (``protocol.py``; with
``previous_response_id``, the stored conversation first) admitted by
``OpenAIRoutes.open_chat``, the path of ``/v1/chat/completions`` (validation,
queue bounds, deadlines, per-key limits, metrics, cancellation on
disconnect); its chunks become the Response object and its events
(``events.py``). Completed, incomplete and failed responses are stored
(``store: true``, the default) before the final event goes out, so a
client that reads the end of a stream can retrieve the response at once.

A stream's headers go out with its first chunk: a request refused or
failed before any (a deadline while queued) keeps its HTTP status; an error
after that ends the stream with an ``error`` event and ``response.failed``.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.encoding import dumps
from jitney.scheduler.api.http.openai.protocol import APIError
from jitney.scheduler.api.http.openai.routes import ChatRun, OpenAIRoutes
from jitney.scheduler.api.http.openai_responses.events import Event, ResponseAssembler, TranslationError
from jitney.scheduler.api.http.openai_responses.items import chat_messages
from jitney.scheduler.api.http.openai_responses.protocol import CreateRequest, parse_create
from jitney.scheduler.api.http.openai_responses.store import ResponseStore, StoreConfig
from jitney.scheduler.api.http.sse import event_stream

log = logging.getLogger("jitney.scheduler")

# The chat path's parameter names -> the Responses API's (errors from open_chat).
_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
           ("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
           ("response_format", "text.format"), ("tool_choice.function", "tool_choice"))


class ResponsesRoutes:
    """The Responses API over ``chat``'s chat path; ``store`` None: no store."""

    def __init__(self, chat: OpenAIRoutes, store: StoreConfig | None) -> None:
        self.chat = chat
        self.store = (ResponseStore(store) if store is not None and store.directory is not None
                      else None)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_get("/v1/responses/{id}/input_items", self.input_items)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self.store is not None:
            self.store.close()

    # -- routes
    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        req = parse_create(body)
        prior: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prior = await self._previous(req.previous_response_id)
        conversation = prior + req.items
        messages = chat_messages(req.instructions, conversation, first_new=len(prior))
        run = await self._open(request, dict(req.chat_args, messages=messages))
        try:
            response_id = "resp_" + run.id.partition("-")[2]
            assembler = ResponseAssembler(response_id, run.model, req.echo)
            if req.stream:
                return await self._stream(request, run, assembler, req, conversation)
            return await self._collect(run, assembler, req, conversation)
        finally:
            run.close()     # no-op once ended; a disconnect (handler cancelled) frees the blocks

    async def retrieve(self, request: web.Request) -> web.Response:
        _no_query(request)
        stored = await self._stored(request.match_info["id"])
        return web.json_response(stored, dumps=dumps)

    async def input_items(self, request: web.Request) -> web.Response:
        after, limit, order = _page_query(request)
        response_id = request.match_info["id"]
        found = None if self.store is None else await self._guard(self.store.get(response_id))
        if found is None:
            raise _not_found(response_id, self.store is None)
        inputs = found.items[:len(found.items) - len(found.response.get("output", []))]
        # (Items stored without an id, by an older server, are named by their place.)
        inputs = [item if "id" in item else dict(item, id=f"item_{k}") for k, item in enumerate(inputs)]
        if order == "desc":
            inputs = inputs[::-1]
        start = 0
        if after is not None:
            at = next((k for k, item in enumerate(inputs) if item.get("id") == after), None)
            if at is None:
                raise APIError(400, f"after: no input item {after[:64]!r} in response {response_id[:64]!r}",
                               param="after")
            start = at + 1
        page = inputs[start:start + limit]
        return web.json_response({"object": "list", "data": page,
                                  "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None,
                                  "has_more": start + limit < len(inputs)}, dumps=dumps)

    async def delete(self, request: web.Request) -> web.Response:
        _no_query(request)
        response_id = request.match_info["id"]
        if self.store is None or not await self._guard(self.store.delete(response_id)):
            raise _not_found(response_id, self.store is None)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    # -- the store
    async def _stored(self, response_id: str) -> dict[str, Any]:
        found = None if self.store is None else await self._guard(self.store.get(response_id))
        if found is None:
            raise _not_found(response_id, self.store is None)
        return found.response

    async def _previous(self, response_id: str) -> list[dict[str, Any]]:
        found = None if self.store is None else await self._guard(self.store.get(response_id))
        if found is None:
            why = (": this server does not store responses (--no-responses-store)" if self.store is None
                   else " (it was not stored, was deleted or aged out of the store)")
            raise APIError(400, f"previous_response_id: no stored response {response_id[:64]!r}{why}",
                           param="previous_response_id", code="previous_response_not_found")
        return found.items

    async def _guard(self, call: Any) -> Any:
        try:
            return await call
        except sqlite3.Error as exc:
            log.error("the responses store failed: %s", exc)
            raise APIError(500, f"the responses store failed: {exc}") from None

    async def _save(self, req: CreateRequest, assembler: ResponseAssembler,
                    conversation: list[dict[str, Any]]) -> str | None:
        """Store the response (when asked and a store is on); the reason it could not be, or None."""
        if not req.store or self.store is None:
            return None
        try:
            stored = await self.store.put(assembler.response(), conversation + assembler.output)
        except sqlite3.Error as exc:
            log.error("the responses store failed: %s", exc)
            return f"the response could not be stored: {exc}"
        if not stored:
            return "the response is larger than the store's size cap (--responses-store-max-mb): not stored"
        return None

    # -- the chat path
    async def _open(self, request: web.Request, body: dict[str, Any]) -> ChatRun:
        try:
            return await self.chat.open_chat(request, body, id_prefix="resp", door="responses")
        except APIError as exc:
            raise _renamed(exc) from None

    async def _collect(self, run: ChatRun, assembler: ResponseAssembler, req: CreateRequest,
                       conversation: list[dict[str, Any]]) -> web.Response:
        assembler.start()
        try:
            async for chunk in run.chunks():
                assembler.feed(chunk)
        except TranslationError as exc:
            raise APIError(500, f"the answer could not be translated: {exc}") from None
        assembler.finish()
        problem = await self._save(req, assembler, conversation)
        if problem is not None:
            raise APIError(500, problem, code="store_failed")
        return web.json_response(assembler.response(), dumps=dumps)

    async def _stream(self, request: web.Request, run: ChatRun, assembler: ResponseAssembler,
                      req: CreateRequest, conversation: list[dict[str, Any]]) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        try:
            try:
                async for chunk in run.chunks():
                    if response is None:    # headers with the first chunk: errors before keep their status
                        response = event_stream()
                        await response.prepare(request)
                        await _send(response, assembler.start())
                    await _send(response, assembler.feed(chunk))
                closing = assembler.end()
            except (APIError, TranslationError) as exc:
                error = exc if isinstance(exc, APIError) else APIError(500, f"the answer could not be "
                                                                            f"translated: {exc}")
                if response is None:
                    return error.response()
                closing = assembler.end_failed(error.message, _error_code(error))
            if response is None:      # cannot happen: a chat stream ends with its usage chunk
                raise APIError(500, "the request ended without an answer")
            problem = await self._save(req, assembler, conversation)
            if problem is not None:
                closing.append(assembler.error_event(problem, "store_failed"))
            await _send(response, closing + [assembler.final_event()])
            await response.write_eof()
        except ConnectionResetError:  # the client went away; ``create`` cancels the request
            pass
        return response if response is not None else web.Response(status=499)


async def _send(response: web.StreamResponse, events: list[Event]) -> None:
    """Typed server-sent events: ``event: TYPE`` then ``data: {event}``."""
    if events:
        await response.write("".join(f"event: {e['type']}\ndata: {dumps(e)}\n\n" for e in events).encode())


def _error_code(error: APIError) -> str:
    return "rate_limit_exceeded" if error.status == 429 else "server_error"


def _renamed(exc: APIError) -> APIError:
    """A chat-path error with its parameter named as the Responses API names it."""
    if exc.param is None:
        return exc
    for chat, ours in _PARAMS:
        if exc.param == chat or exc.param.startswith((chat + ".", chat + "[")):
            param = "input" if chat == "messages" else ours + exc.param[len(chat):]
            message = exc.message.removeprefix(f"{exc.param}: ")
            return APIError(exc.status, f"{param}: {message}", param=param, code=exc.code)
    if exc.param.startswith("tools[") and ".function." in exc.param:
        param = exc.param.replace(".function.", ".", 1)
        message = exc.message.removeprefix(f"{exc.param}: ")
        return APIError(exc.status, f"{param}: {message}", param=param, code=exc.code)
    return exc


def _not_found(response_id: str, no_store: bool) -> APIError:
    why = ": this server does not store responses (--no-responses-store)" if no_store else ""
    return APIError(404, f"Response with id '{response_id[:64]}' not found{why}.", param="response_id",
                    code="not_found")


def _page_query(request: web.Request) -> tuple[str | None, int, str]:
    """``after``, ``limit`` and ``order`` of a list request, checked; anything else refused."""
    query = request.query
    for key in query:
        if key not in ("after", "limit", "order"):
            name = key.removesuffix("[]")   # the SDKs send a list as ``include[]=...``
            raise APIError(400, f"{name}: is not supported by Jitney (after, limit, order)", param=name,
                           code="unsupported_parameter")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise APIError(400, f"limit: must be an integer from 1 to 100, got {limit_text[:32]!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be 'asc' or 'desc', got {order[:32]!r}", param="order")
    return query.get("after"), int(limit_text), order


def _no_query(request: web.Request) -> None:
    for key in request.query:
        raise APIError(400, f"{key}: is not supported by Jitney", param=key, code="unsupported_parameter")
