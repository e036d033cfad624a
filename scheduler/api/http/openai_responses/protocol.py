"""A Responses API request (``POST /v1/responses``) as a chat completions body.

``parse_create`` validates the request (every error an OpenAI-shaped 400
naming the parameter, e.g. ``input[3].call_id``) into a ``CreateRequest``:
the new input as normalized items (``items.py``, which also renders a
conversation as chat messages), the echoed settings, and the chat body's
arguments.

Decisions:
  * ``instructions`` is a system turn before the conversation, not kept in
    it: a later response that names this one as previous does not inherit
    it (as OpenAI does).
  * Only function tools; ``text.format`` text | json_object | json_schema.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jitney.scheduler.api.http.openai.protocol import APIError
from jitney.scheduler.api.http.openai_responses.items import bad, need_str, parse_input

# Arguments accepted, and those OpenAI defines that Jitney refuses unless
# null or one of the values that ask for nothing.
_ARGS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
    "metadata", "user",
})
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "include": ((),), "truncation": ("disabled",), "reasoning": (),
    "service_tier": ("auto", "default"), "conversation": (), "max_tool_calls": (), "prompt": (),
    "prompt_cache_key": (), "safety_identifier": (), "stream_options": (), "top_logprobs": (0,),
}
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


@dataclass
class CreateRequest:
    """A validated ``POST /v1/responses`` body."""

    items: list[dict[str, Any]]                 # the new input, normalized
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # The chat body's arguments other than ``messages`` (model, tools, sampling).
    chat_args: dict[str, Any] = field(default_factory=dict)
    # The request's own settings, echoed in the Response object.
    echo: dict[str, Any] = field(default_factory=dict)


def parse_create(body: Any) -> CreateRequest:
    """Validate a create request; raises APIError (400) naming the parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    args = {k: v for k, v in body.items() if v is not None}
    for key, value in args.items():
        if key in _ARGS:
            continue
        if key in _UNSUPPORTED:
            normal = tuple(value) if isinstance(value, list) else value
            if any(normal == e and type(normal) is type(e) for e in _UNSUPPORTED[key]):
                continue
            raise bad(key, "is not supported by Jitney", code="unsupported_parameter")
        raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key,
                       code="unknown_parameter")
    if "input" not in args:
        raise bad("input", "is required: a string or a list of input items")
    out = CreateRequest(parse_input(args["input"]))
    out.instructions = _str(args, "instructions")
    out.stream = _bool(args, "stream", False)
    out.store = _bool(args, "store", True)
    out.previous_response_id = _str(args, "previous_response_id")
    tools = _tools(args.get("tools"))
    tool_choice = _tool_choice(args.get("tool_choice"), tools)
    parallel = _bool(args, "parallel_tool_calls", True)
    fmt = _text_format(args.get("text"))
    max_output = _int(args, "max_output_tokens", 1, 2**32 - 1)
    temperature = _number(args, "temperature", 0.0, 2.0)
    top_p = _number(args, "top_p", 0.0, 1.0)
    metadata = _metadata(args.get("metadata"))
    user = _str(args, "user")
    model = _str(args, "model")
    chat = out.chat_args
    for key, value in (("model", model), ("max_completion_tokens", max_output),
                       ("temperature", temperature), ("top_p", top_p), ("user", user)):
        if value is not None:
            chat[key] = value
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
                         for t in tools]
        chat["tool_choice"] = _chat_tool_choice(tool_choice)
        chat["parallel_tool_calls"] = parallel
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        spec = {"name": fmt["name"], "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    out.echo = {"instructions": out.instructions, "tools": tools, "tool_choice": tool_choice,
                "parallel_tool_calls": parallel, "text": {"format": fmt},
                "max_output_tokens": max_output, "temperature": temperature,
                "top_p": top_p, "metadata": metadata, "user": user,
                "previous_response_id": out.previous_response_id, "store": out.store,
                "truncation": "disabled", "background": False, "reasoning": None,
                "service_tier": "default"}
    return out


# -- tools and formats ----------------------------------------------------


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", "must be a list of function tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, "must be an object")
        if tool.get("type") != "function":
            raise bad(f"{where}.type", f"{str(tool.get('type'))[:32]!r} is not supported by Jitney "
                      "(function tools only)", code="unsupported_value")
        name = need_str(tool, "name", where)
        if name in names:
            raise bad(f"{where}.name", f"{name[:64]!r} is the name of an earlier tool")
        names.add(name)
        out: dict[str, Any] = {"type": "function", "name": name}
        if tool.get("description") is not None:
            out["description"] = need_str(tool, "description", where)
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.parameters", "must be a JSON Schema object")
        out["parameters"] = params
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{where}.strict", "must be true or false")
        out["strict"] = strict
        for key in tool:
            if key not in out and key != "type" and tool[key] is not None:
                raise bad(f"{where}.{key}", "is not supported by Jitney", code="unsupported_parameter")
        tools.append(out)
    return tools


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> Any:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise bad("tool_choice", "'required' needs tools")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise bad("tool_choice.name", "is required: a string")
        if name not in {t["name"] for t in tools}:
            raise bad("tool_choice.name", f"{name[:64]!r} is not one of the request's tools")
        return {"type": "function", "name": name}
    raise bad("tool_choice", "must be 'auto', 'none', 'required' or {type: 'function', name}",
              code="unsupported_value")


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(value: Any) -> dict[str, Any]:
    if value is None:
        return {"type": "text"}
    if not isinstance(value, dict):
        raise bad("text", "must be an object")
    for key in value:
        if key != "format" and value[key] is not None:
            raise bad(f"text.{key}", "is not supported by Jitney", code="unsupported_parameter")
    fmt = value.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad("text.format.type", f"{str(kind)[:32]!r} is not supported (text, json_object, json_schema)",
                  code="unsupported_value")
    name = need_str(fmt, "name", "text.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad("text.format.schema", "is required: a JSON Schema object")
    out = {"type": "json_schema", "name": name, "schema": schema,
           "strict": _bool(fmt, "strict", None, "text.format.")}
    if fmt.get("description") is not None:
        out["description"] = need_str(fmt, "description", "text.format")
    return out


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > METADATA_MAX_KEYS:
        raise bad("metadata", f"must be an object of at most {METADATA_MAX_KEYS} string values")
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise bad("metadata", f"key {key[:32]!r}... is longer than {METADATA_KEY_CHARS} characters")
        if not isinstance(item, str) or len(item) > METADATA_VALUE_CHARS:
            raise bad(f"metadata.{key}", f"must be a string of at most {METADATA_VALUE_CHARS} characters")
    return dict(value)


# -- scalars --------------------------------------------------------------


def _str(args: Mapping[str, Any], key: str) -> str | None:
    value = args.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(key, "must be a string")
    return value


def _bool(args: Mapping[str, Any], key: str, default: Any, prefix: str = "") -> Any:
    value = args.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(prefix + key, "must be true or false")
    return value


def _int(args: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(key, "must be an integer")
    if not low <= value <= high:
        raise bad(key, f"must be in [{low}, {high}], got {value}")
    return value


def _number(args: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(key, "must be a number")
    if not low <= value <= high:
        raise bad(key, f"must be in [{low:g}, {high:g}], got {value:g}")
    return float(value)
