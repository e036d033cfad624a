"""The OpenAI API's answers: a chat or completion response, whole or as
stream chunks, with its usage and logprobs (token strings in logprobs are
the token decoded alone). A chat answer with tools or from a reasoning model
is split as it streams (scheduler/api/tools/stream.py): ``content``,
``reasoning_content`` (vLLM's name) and ``tool_calls`` (OpenAI's deltas: index,
id, type and name in a call's first delta, argument fragments after);
``finish_reason`` "tool_calls" when the model ended after making calls."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from jitney.scheduler.api.http.openai.protocol import ParsedRequest
from jitney.scheduler.api.tools.formats import ToolFormat
from jitney.scheduler.api.tools.stream import Deltas, OutputParser, ParsedCall
from jitney.scheduler.core.detokenizer import TokenTexts
from jitney.scheduler.core.engine import StreamEvent
from jitney.scheduler.core.request import FinishReason

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.END_OF_SEQUENCE: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
}


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def usage_dict(event: StreamEvent) -> dict[str, Any]:
    return {"prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_prompt_tokens}}


@dataclass
class _Choice:
    """One choice as it accumulates (a non-streamed answer) or streams."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0          # completions' logprobs.text_offset so far
    started: bool = False         # streaming: its first chunk went out
    parser: OutputParser | None = None   # a chat answer with tools or reasoning


class _Formatter:
    """Builds the JSON of one request's answer, chunks or whole."""

    def __init__(self, parsed: ParsedRequest, response_id: str, model: str,
                 token_text: TokenTexts, echo_text: str, *, tool_format: ToolFormat | None = None,
                 reasoning: str = "off") -> None:
        """``tool_format``: parse tool calls in this format (None: none);
        ``reasoning``: OutputParser's reasoning mode."""
        self.parsed = parsed
        self.tool_format = tool_format
        self.reasoning = reasoning
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.echo_text = echo_text

    def _parser(self, choice: _Choice) -> OutputParser | None:
        if choice.parser is None and self.parsed.chat and (self.tool_format is not None
                                                           or self.reasoning != "off"):
            choice.parser = OutputParser(self.tool_format, self.reasoning)
        return choice.parser

    def _finish_reason(self, choice: _Choice, reason: str) -> str:
        if reason == "stop" and choice.parser is not None and choice.parser.calls:
            return "tool_calls"
        return reason

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.parsed.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, choice: _Choice, ids: list[int], lps: list[float],
                 tops: list[list[tuple[int, float]]]) -> dict[str, Any] | None:
        if not self.parsed.logprobs:
            return None
        want_top = self.parsed.top_logprobs
        tops = tops + [[] for _ in range(len(ids) - len(tops))]
        if self.parsed.chat:
            content = []
            for token, lp, top in zip(ids, lps, tops):
                text = self.token_text(token)
                content.append({
                    "token": text, "logprob": _logprob(lp), "bytes": self.token_text.raw(token),
                    "top_logprobs": [{"token": self.token_text(t), "logprob": _logprob(v),
                                      "bytes": self.token_text.raw(t)}
                                     for t, v in top[:want_top]]})
            return {"content": content, "refusal": None}
        texts = [self.token_text(t) for t in ids]
        offsets = []
        for text in texts:
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        top_dicts = ([{self.token_text(t): _logprob(v) for t, v in top[:want_top]} for top in tops]
                     if want_top else None)
        return {"tokens": texts, "token_logprobs": [_logprob(v) for v in lps],
                "top_logprobs": top_dicts, "text_offset": offsets}

    # -- whole answers
    def full(self, choices: list[_Choice], usage: dict[str, Any] | None) -> dict[str, Any]:
        out = self._head(stream=False)
        items = []
        for c in choices:
            lp = self.logprobs(c, c.token_ids, c.logprobs, c.top)
            if self.parsed.chat:
                items.append({"index": c.index, "logprobs": lp, "message": self._message(c),
                              "finish_reason": self._finish_reason(c, c.finish_reason or "stop")
                              if c.finish_reason is not None else None})
            else:
                items.append({"index": c.index, "finish_reason": c.finish_reason, "logprobs": lp,
                              "text": self.echo_text + c.text})
        out["choices"] = items
        out["usage"] = usage
        return out

    def _message(self, c: _Choice) -> dict[str, Any]:
        parser = self._parser(c)
        if parser is None:
            return {"role": "assistant", "content": c.text, "refusal": None}
        parser.feed(c.text)
        parser.finish()
        message: dict[str, Any] = {"role": "assistant", "content": parser.content, "refusal": None}
        if self.reasoning != "off":
            message["reasoning_content"] = parser.reasoning or None
        if parser.calls:
            message["content"] = parser.content.strip() or None
            message["tool_calls"] = [_call_dict(call) for call in parser.calls]
        return message

    # -- streamed chunks
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._head(stream=True)
        out["choices"] = choices
        if self.parsed.include_usage:
            out["usage"] = None
        return out

    def _choice_chunk(self, index: int, text: str | None, logprobs: Any,
                      finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        if self.parsed.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason}])
        return self._chunk([{"index": index, "text": text or "", "logprobs": logprobs,
                             "finish_reason": finish_reason}])

    def chunks(self, choice: _Choice, event: StreamEvent) -> list[dict[str, Any]]:
        out = []
        if not choice.started:
            choice.started = True
            if self.parsed.chat:
                out.append(self._choice_chunk(choice.index, "", None, None, role=True))
            elif self.echo_text:
                out.append(self._choice_chunk(choice.index, self.echo_text, None, None))
                choice.text_offset = len(self.echo_text)
        lp = self.logprobs(choice, list(event.token_ids), list(event.logprobs),
                           list(event.top_logprobs))
        parser = self._parser(choice)
        if parser is not None:
            deltas = parser.feed(event.text)
            if event.finish_reason is not None:
                rest = parser.finish()
                deltas.content += rest.content
                deltas.reasoning += rest.reasoning
            if deltas.content or deltas.reasoning or deltas.calls or (lp is not None and event.token_ids):
                out.append(self._chunk([{"index": choice.index, "delta": _delta(deltas), "logprobs": lp,
                                         "finish_reason": None}]))
        elif event.text or (lp is not None and event.token_ids):
            out.append(self._choice_chunk(choice.index, event.text, lp, None))
        if event.finish_reason is not None:
            reason = self._finish_reason(choice, FINISH_REASONS.get(event.finish_reason, "stop"))
            out.append(self._choice_chunk(choice.index, None if self.parsed.chat else "", None,
                                          reason))
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        out = self._head(stream=True)
        out["choices"] = []
        out["usage"] = usage
        return out



def _call_dict(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta(deltas: Deltas) -> dict[str, Any]:
    """A chunk's delta: the keys that have something."""
    out: dict[str, Any] = {}
    if deltas.reasoning:
        out["reasoning_content"] = deltas.reasoning
    if deltas.content:
        out["content"] = deltas.content
    if deltas.calls:
        calls = []
        for d in deltas.calls:
            item: dict[str, Any] = {"index": d.index}
            if d.id:
                item.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
            else:
                item["function"] = {"arguments": d.arguments}
            calls.append(item)
        out["tool_calls"] = calls
    return out
