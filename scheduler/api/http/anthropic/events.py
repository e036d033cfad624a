"""OpenAI ``chat.completion.chunk`` dicts (the chat path's answer) into Anthropic's
Message and its stream events.

``MessageAssembler.feed(chunk)`` returns the events the chunk makes, in order:

    message_start                           before anything else
    content_block_start  (index i)          a new block: thinking (reasoning_content),
                                            text (content) or tool_use (a tool call's first delta)
    content_block_delta  thinking_delta / text_delta / input_json_delta (partial_json)
    content_block_stop                      when the next block starts, or at the end
    message_delta        stop_reason, stop_sequence, usage.output_tokens
    message_stop

``finish(...)`` gives the closing events; ``message()`` the whole Message (its
tool_use ``input`` parsed from the concatenated argument fragments). Only the
request's first choice is read (Anthropic has no n).
"""

from __future__ import annotations

import json
from typing import Any

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessageAssembler:
    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.id, self.model = message_id, model
        self.usage: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": 0,
                                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None          # the kind of the last block while it is open
        self._calls: dict[int, int] = {}       # a tool call's OpenAI index -> its block index
        self._arguments: dict[int, list[str]] = {}   # block index -> argument fragments
        self.finish_reason: str | None = None
        self.started = False

    def start(self) -> list[dict[str, Any]]:
        self.started = True
        return [{"type": "message_start", "message": self._message_head(content=[], stop_reason=None,
                                                                        stop_sequence=None)}]

    def _message_head(self, **rest: Any) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, **rest,
                "usage": dict(self.usage)}

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events = [] if self.started else self.start()
        usage = chunk.get("usage")
        if usage:
            self.usage["output_tokens"] = usage.get("completion_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            self.usage["cache_read_input_tokens"] = cached
            self.usage["input_tokens"] = usage.get("prompt_tokens", self.usage["input_tokens"]) - cached
        for choice in chunk.get("choices", []):
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text_block("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_block("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text_block(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self._close()
            block: dict[str, Any] = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                     else {"type": "text", "text": ""})
            self.blocks.append(block)
            self._open = kind
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        field = "thinking" if kind == "thinking" else "text"
        self.blocks[-1][field] += text
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                       "delta": {"type": f"{kind}_delta", field: text}})
        return events

    def _tool_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        if index not in self._calls:
            events += self._close()
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{len(self.blocks)}",
                     "name": function.get("name", ""), "input": {}}
            self.blocks.append(block)
            self._calls[index] = len(self.blocks) - 1
            self._arguments[len(self.blocks) - 1] = []
            self._open = f"tool_use:{index}"
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                           "content_block": dict(block)})
        at = self._calls[index]
        fragment = function.get("arguments") or ""
        if fragment:
            self._arguments[at].append(fragment)
            events.append({"type": "content_block_delta", "index": at,
                           "delta": {"type": "input_json_delta", "partial_json": fragment}})
        return events

    def finish(self, stop_sequence: str | None) -> list[dict[str, Any]]:
        """The closing events, once the chunks are done; ``stop_sequence`` the stop
        string that ended the answer, if one did."""
        events = [] if self.started else self.start()
        events += self._close()
        self._settle_inputs()
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": self.stop_reason(stop_sequence), "stop_sequence": stop_sequence},
                       "usage": {"output_tokens": self.usage["output_tokens"]}})
        events.append({"type": "message_stop"})
        return events

    def stop_reason(self, stop_sequence: str | None) -> str:
        if stop_sequence is not None:
            return "stop_sequence"
        return STOP_REASONS.get(self.finish_reason or "stop", "end_turn")

    def _settle_inputs(self) -> None:
        for at, fragments in self._arguments.items():
            text = "".join(fragments)
            try:
                value = json.loads(text) if text else {}
            except ValueError:     # cut off by max_tokens: the text as far as it got
                value = {"_partial_arguments": text}
            self.blocks[at]["input"] = value if isinstance(value, dict) else {"_arguments": value}

    def message(self, stop_sequence: str | None) -> dict[str, Any]:
        """The whole Message (call after the last chunk)."""
        self._settle_inputs()
        return self._message_head(content=self.blocks, stop_reason=self.stop_reason(stop_sequence),
                                  stop_sequence=stop_sequence)
