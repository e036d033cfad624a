"""Anthropic's Messages API requests, checked and translated into an OpenAI chat
completions body (the chat path every door shares, ``OpenAIRoutes.open_chat``),
and errors in Anthropic's JSON shape.

    Anthropic                                   chat completions
    system (text or text blocks)                a first system message
    user text blocks                            a user message (blocks joined by newlines)
    user tool_result blocks                     role "tool" messages (tool_call_id), before the text
    assistant text + tool_use blocks            an assistant message with tool_calls (input as JSON)
    assistant thinking blocks                   dropped (a template renders no past reasoning)
    tools [{name, description, input_schema}]   tools [{type: function, function: {..., parameters}}]
    tool_choice auto / any / tool / none        "auto" / "required" / a named function / "none"
      disable_parallel_tool_use                 parallel_tool_calls false
    max_tokens (required)                       max_completion_tokens
    stop_sequences, temperature, top_p, top_k   stop, temperature, top_p, top_k
    metadata.user_id                            user
    thinking {type: disabled}                   chat_template_kwargs {"enable_thinking": false}

The chat path's own refusals come back as OpenAI ``APIError``s naming OpenAI's
argument; ``MessagesRequest.param`` names it as this request does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.encoding import dumps

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}

_ARGS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
         "stream", "metadata", "tools", "tool_choice", "thinking", "service_tier"}
_COUNT_ARGS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
_BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
               "tool_use": {"type", "id", "name", "input", "cache_control"},
               "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
               "thinking": {"type", "thinking", "signature"},
               "redacted_thinking": {"type", "data"}}


class AnthropicError(Exception):
    """An error answered in Anthropic's shape: ``{"type": "error", "error": {type, message}}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": ERROR_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, dumps=dumps)


def _bad(where: str, message: str) -> AnthropicError:
    return AnthropicError(400, f"{where}: {message}")


@dataclass
class MessagesRequest:
    """A checked request: the chat body, whether it streams, and where each chat
    message came from (``messages[j]`` or ``system``), to name fields in errors."""

    chat: dict[str, Any]
    stream: bool = False
    thinking: bool = False
    origins: list[str] = field(default_factory=list)

    def param(self, openai_param: str | None) -> str | None:
        """This request's name of the chat path's ``openai_param``."""
        if openai_param is None:
            return None
        found = re.match(r"messages\[(\d+)\](.*)", openai_param)
        if found and int(found.group(1)) < len(self.origins):
            return self.origins[int(found.group(1))] + found.group(2)
        renames = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
                   "user": "metadata.user_id", "chat_template_kwargs": "thinking"}
        if openai_param in renames:
            return renames[openai_param]
        schema = re.sub(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema", openai_param)
        return re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", schema)


def parse_messages_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """Check ``body`` (a /v1/messages or, ``count_only``, a /v1/messages/count_tokens
    request) and translate it. Raises AnthropicError (400) naming the field."""
    if not isinstance(body, dict):
        raise AnthropicError(400, "the request body must be a JSON object")
    allowed = _COUNT_ARGS if count_only else _ARGS
    for key in body:
        if key not in allowed:
            raise _bad(key, "Extra inputs are not permitted")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "Field required: a string")
    out = MessagesRequest({"model": model})
    chat = out.chat
    if not count_only:
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int:
            raise _bad("max_tokens", "Field required: an integer")
        if max_tokens < 1:
            raise _bad("max_tokens", "must be at least 1")
        chat["max_completion_tokens"] = max_tokens
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream", "must be a boolean")
        out.stream = stream
        _sampling(body, chat)
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
        out.origins.append("system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "Field required: a non-empty list of messages")
    for j, message in enumerate(raw):
        for m in _message(message, f"messages[{j}]"):
            messages.append(m)
            out.origins.append(f"messages[{j}]")
    chat["messages"] = messages
    _tools(body, chat)
    out.thinking = _thinking(body, chat)
    return out


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(key, "must be a number")
            chat[key] = value
    temperature = body.get("temperature")
    if temperature is not None and not 0.0 <= temperature <= 1.0:
        raise _bad("temperature", f"must be between 0 and 1, got {temperature}")
    top_k = body.get("top_k")
    if top_k is not None:
        if type(top_k) is not int or top_k < 0:
            raise _bad("top_k", "must be a non-negative integer")
        chat["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop_sequences", "must be a list of non-empty strings")
        if stops:
            chat["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise _bad("metadata", "must be an object with at most user_id")
        user = metadata.get("user_id")
        if user is not None:
            if not isinstance(user, str):
                raise _bad("metadata.user_id", "must be a string")
            chat["user"] = user
    tier = body.get("service_tier")
    if tier not in (None, "auto", "standard_only"):
        raise _bad("service_tier", "must be auto or standard_only")


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, "must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        at = f"{where}[{i}]"
        _check_block(block, at)
        if block["type"] != "text":
            raise _bad(f"{at}.type", f"{block['type']!r} is not allowed here (text blocks only)")
        texts.append(block["text"])
    return "\n".join(texts)


def _check_block(block: Any, at: str) -> None:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(at, "must be a content block: an object with a type")
    kind = block["type"]
    if kind not in _BLOCK_KEYS:
        raise _bad(f"{at}.type", f"{kind[:32]!r} blocks are not supported by Jitney "
                   f"(supported: {', '.join(sorted(_BLOCK_KEYS))})")
    for key, value in block.items():
        # null extras: what an SDK's model_dump of its own response blocks echoes back
        if key not in _BLOCK_KEYS[kind] and value is not None:
            raise _bad(f"{at}.{key}", "Extra inputs are not permitted")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _bad(f"{at}.text", "Field required: a string")


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message."""
    if not isinstance(message, dict):
        raise _bad(where, "must be an object with role and content")
    for key in message:
        if key not in ("role", "content"):
            raise _bad(f"{where}.{key}", "Extra inputs are not permitted")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role", f"must be user or assistant, got {str(role)[:32]!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "Field required: a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        _check_block(block, at)
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            if role != "assistant":
                raise _bad(f"{at}.type", "tool_use blocks belong to assistant messages")
            calls.append(_tool_use(block, at))
        elif kind == "tool_result":
            if role != "user":
                raise _bad(f"{at}.type", "tool_result blocks belong to user messages")
            results.append(_tool_result(block, at))
        elif role != "assistant":
            raise _bad(f"{at}.type", f"{kind} blocks belong to assistant messages")
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise _bad(f"{at}.{key}", "Field required: a string")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"{at}.input", "Field required: an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise _bad(f"{at}.tool_use_id", "Field required: a string")
    content = block.get("content", "")
    text = _text(content, f"{at}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{at}.is_error", "must be a boolean")
    return {"role": "tool", "tool_call_id": block["tool_use_id"],
            "content": f"Error: {text}" if is_error else text}


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of tools")
        out = []
        for i, tool in enumerate(tools):
            at = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise _bad(at, "must be an object")
            kind = tool.get("type", "custom")
            if kind != "custom":
                raise _bad(f"{at}.type", f"{str(kind)[:48]!r} (a server tool) is not supported by Jitney: "
                           "only custom tools (name, description, input_schema)")
            for key in tool:
                if key not in ("type", "name", "description", "input_schema", "cache_control"):
                    raise _bad(f"{at}.{key}", "Extra inputs are not permitted")
            if not isinstance(tool.get("name"), str):
                raise _bad(f"{at}.name", "Field required: a string")
            if not isinstance(tool.get("input_schema"), dict):
                raise _bad(f"{at}.input_schema", "Field required: a JSON schema object")
            function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                if not isinstance(tool["description"], str):
                    raise _bad(f"{at}.description", "must be a string")
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        if out:
            chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", "must be an object whose type is auto, any, tool or none")
    kind = choice["type"]
    for key in choice:
        if key not in ("type", "name", "disable_parallel_tool_use") or (key == "name") != (kind == "tool") \
                and key == "name":
            raise _bad(f"tool_choice.{key}", "Extra inputs are not permitted")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "Field required: the tool's name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if "tools" not in chat and kind != "none":
        raise _bad("tool_choice", f"{kind!r} needs tools")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
        if "tools" in chat:
            chat["parallel_tool_calls"] = not parallel


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> bool:
    """Whether the request asked for thinking; disabled closes a reasoning template's
    thinking (Qwen3's enable_thinking)."""
    thinking = body.get("thinking")
    if thinking is None:
        return False
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        raise _bad("thinking", "must be an object whose type is enabled or disabled")
    if thinking["type"] == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
        return False
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise _bad("thinking.budget_tokens", "Field required: a positive integer")
    return True
