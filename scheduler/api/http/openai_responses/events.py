"""OpenAI ``chat.completion.chunk`` dicts as the Responses API's objects and
typed stream events: pure, no I/O (``ResponseAssembler``).

A stream is ``start()`` (response.created, response.in_progress), then
``feed(chunk)`` per chunk, then ``finish()`` (response.completed, or
response.incomplete when the answer hit its token limit) or
``fail(message)`` (an ``error`` event, then response.failed); ``end`` /
``end_failed`` then ``final_event`` split those around work that must come
before the final event (storing the response). Each output
item goes out as

    message        output_item.added, content_part.added, output_text.delta ...,
                   output_text.done, content_part.done, output_item.done
    function_call  output_item.added, function_call_arguments.delta ...,
                   function_call_arguments.done, output_item.done
    reasoning      output_item.added, content_part.added, reasoning_text.delta ...,
                   reasoning_text.done, content_part.done, output_item.done

An item opens when the chunks switch to its kind (``delta.content``,
``delta.reasoning_content``, or a ``delta.tool_calls`` entry with a new
``index``: its first delta carries ``id`` and ``function.name``, later ones
argument fragments) and closes when the next opens or the stream ends, so
items never interleave. Every event has ``type`` and ``sequence_number``
(0, 1, ... in order).
"""

from __future__ import annotations

import time
from typing import Any

Event = dict[str, Any]


class TranslationError(ValueError):
    """A chunk sequence that breaks the chat stream's shape (a bug upstream)."""


class ResponseAssembler:
    """Builds one response from its chat chunks; ``echo`` holds the request's
    settings that the Response object repeats (instructions, tools, ...)."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any],
                 created_at: int | None = None) -> None:
        self.id, self.model, self.echo = response_id, model, echo
        self.created_at = int(time.time()) if created_at is None else created_at
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self._seq = 0
        self._open: dict[str, Any] | None = None      # the item being streamed (output's last)
        self._calls: dict[int, dict[str, Any]] = {}   # chat tool-call index -> its item
        self._base = response_id.removeprefix("resp_")

    # -- the Response object
    def response(self) -> dict[str, Any]:
        incomplete = ({"reason": "max_output_tokens"} if self.status == "incomplete" else None)
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "error": self.error, "incomplete_details": incomplete,
                "model": self.model, "output": [_copy_item(item) for item in self.output],
                "usage": None if self.usage is None else self._usage(self.usage), **self.echo}

    def _usage(self, chat: dict[str, Any]) -> dict[str, Any]:
        """Chat usage as Responses usage. Reasoning tokens: the chat usage's count when
        it has one, else 0 when nothing was reasoned, else unknown (left out)."""
        cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out: dict[str, Any] = {
            "input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["prompt_tokens"] + chat["completion_tokens"],
            "input_tokens_details": {"cached_tokens": cached}}
        reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens")
        if reasoning is None and not any(item["type"] == "reasoning" for item in self.output):
            reasoning = 0
        if reasoning is not None:
            out["output_tokens_details"] = {"reasoning_tokens": reasoning}
        return out

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=self.response())

    # -- the stream
    def start(self) -> list[Event]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one chat chunk (its first choice: Responses has no ``n``)."""
        events: list[Event] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                raise TranslationError(f"a chunk for choice {choice.get('index')}: one choice only")
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[Event]:
        """The closing events: the open item's, then the final lifecycle event."""
        return self.end() + [self.final_event()]

    def fail(self, message: str, code: str = "server_error") -> list[Event]:
        """An answer cut short by an error: the open item ends incomplete."""
        return self.end_failed(message, code) + [self.final_event()]

    def end(self) -> list[Event]:
        """``finish`` without its final event: the status set, the open item closed."""
        self.status = "incomplete" if self.finish_reason == "length" else "completed"
        return self._close(self.status)

    def end_failed(self, message: str, code: str = "server_error") -> list[Event]:
        """``fail`` without its final event."""
        events = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": code, "message": message}
        return events + [self.error_event(message, code)]

    def error_event(self, message: str, code: str) -> Event:
        return self._event("error", code=code, message=message, param=None)

    def final_event(self) -> Event:
        """response.completed, .incomplete or .failed, as the status is."""
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[self.status]
        return self._lifecycle(kind)

    # -- items
    def _new_item(self, item: dict[str, Any]) -> list[Event]:
        events = self._close("completed")
        self.output.append(item)
        self._open = item
        added = dict(item, content=[]) if "content" in item else dict(item)
        return events + [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=added)]

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != kind:
            index = len(self.output)
            if kind == "message":
                item = {"type": "message", "id": f"msg_{self._base}_{index}", "role": "assistant",
                        "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            else:
                item = {"type": "reasoning", "id": f"rs_{self._base}_{index}", "summary": [],
                        "status": "in_progress", "content": [{"type": "reasoning_text", "text": ""}]}
            events += self._new_item(item)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=dict(item["content"][0])))
        part = item["content"][0]
        part["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, **extra))
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        index = call.get("index")
        if not isinstance(index, int):
            raise TranslationError("a tool-call delta without its index")
        fn = call.get("function") or {}
        events: list[Event] = []
        item = self._calls.get(index)
        if item is None:
            if not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
                raise TranslationError(f"tool call {index}'s first delta lacks its id or name")
            item = {"type": "function_call", "id": f"fc_{self._base}_{len(self.output)}",
                    "call_id": call["id"], "name": fn["name"], "arguments": "", "status": "in_progress"}
            self._calls[index] = item
            events += self._new_item(item)
        elif item is not self._open:
            raise TranslationError(f"tool call {index}'s arguments after the next item began")
        fragment = fn.get("arguments")
        if fragment:
            item["arguments"] += fragment
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, delta=fragment))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.output) - 1              # the open item is always the last
        ids = {"item_id": item["id"], "output_index": index}
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **ids,
                                      name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", **ids, content_index=0,
                                          text=part["text"], logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", **ids, content_index=0,
                                          text=part["text"]))
            events.append(self._event("response.content_part.done", **ids, content_index=0,
                                      part=dict(part)))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=_copy_item(item)))
        return events


def _copy_item(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out

