"""A Responses API request (``POST /v1/responses``) as a chat completions body.

``parse_create`` validates the request (every error an OpenAI-shaped 400
naming the parameter, e.g. ``input[3].call_id``) into a ``CreateRequest``:
the new input as normalized items, the echoed settings, and the chat body's
arguments. ``chat_body`` then renders a conversation (the previous
response's items, then the new ones) as chat messages.

Normalized items (what the store keeps, in order, as the conversation):
    {"type": "message", "role": user|assistant|system, "content": [{"type": "input_text"|"output_text", "text"}]}
    {"type": "function_call", "call_id", "name", "arguments"}      (+ "id", "status" on output items)
    {"type": "function_call_output", "call_id", "output"}
    {"type": "reasoning", ...}                                      (an output item; not re-rendered)

Decisions:
  * ``instructions`` is a system turn before the conversation, not kept in
    it: a later response that names this one as previous does not inherit
    it (as OpenAI does).
  * Role ``developer`` is ``system``. Consecutive ``function_call`` items are
    one assistant turn with parallel ``tool_calls`` (joined to the assistant
    message right before them); each ``function_call_output`` is a ``tool``
    turn and must answer a call earlier in the conversation.
  * Past reasoning items are kept in the conversation but not rendered
    (chat templates drop the reasoning of earlier turns).
  * Only function tools; ``text.format`` text | json_object | json_schema.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jitney.scheduler.api.http.openai.protocol import APIError

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
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


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


# -- input items ----------------------------------------------------------


def parse_input(value: Any) -> list[dict[str, Any]]:
    """``input``, normalized (see the module docstring)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad("input", "must be a string or a list of input items")
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            items.append({"type": "function_call", "call_id": _need_str(item, "call_id", where),
                          "name": _need_str(item, "name", where),
                          "arguments": _need_str(item, "arguments", where)})
        elif kind == "function_call_output":
            items.append({"type": "function_call_output", "call_id": _need_str(item, "call_id", where),
                          "output": _output_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            items.append(dict(item))
        elif isinstance(kind, str):
            raise bad(f"{where}.type", f"{kind[:32]!r} is not supported by Jitney (message, "
                      "function_call, function_call_output, reasoning)", code="unsupported_value")
        else:
            raise bad(f"{where}.type", "is required: a string")
    return items


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str):
        raise bad(f"{where}.role", "is required: a string")
    if role not in _ROLES:
        raise bad(f"{where}.role", f"{role[:32]!r} is not supported (user, assistant, system, developer)",
                  code="unsupported_value")
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(pwhere, "must be an object with a type")
            if part["type"] not in _TEXT_PARTS:
                raise bad(f"{pwhere}.type", f"{part['type'][:32]!r} is not supported by Jitney "
                          "(input_text, output_text)", code="unsupported_value")
            parts.append({"type": part["type"], "text": _need_str(part, "text", pwhere)})
    else:
        raise bad(f"{where}.content", "is required: a string or a list of text parts")
    return {"type": "message", "role": _ROLES[role], "content": parts}


def _output_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise bad(f"{where}[{j}]", "must be an input_text part (text outputs only)",
                          code="unsupported_value")
            texts.append(_need_str(part, "text", f"{where}[{j}]"))
        return "\n".join(texts)
    raise bad(where, "is required: a string or a list of input_text parts")


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
        name = _need_str(tool, "name", where)
        if name in names:
            raise bad(f"{where}.name", f"{name[:64]!r} is the name of an earlier tool")
        names.add(name)
        out: dict[str, Any] = {"type": "function", "name": name}
        if tool.get("description") is not None:
            out["description"] = _need_str(tool, "description", where)
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
    name = _need_str(fmt, "name", "text.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad("text.format.schema", "is required: a JSON Schema object")
    out = {"type": "json_schema", "name": name, "schema": schema,
           "strict": _bool(fmt, "strict", None, "text.format.")}
    if fmt.get("description") is not None:
        out["description"] = _need_str(fmt, "description", "text.format")
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


# -- the conversation as chat messages ------------------------------------


def chat_messages(instructions: str | None, items: list[dict[str, Any]],
                  first_new: int = 0) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` then the conversation ``items``;
    ``items[first_new:]`` are this request's input (``input[i - first_new]``
    in errors), the rest come from the store."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                where = f"input[{i - first_new}].call_id" if i >= first_new else "previous_response_id"
                raise bad(where, f"no function_call with call_id {item['call_id'][:64]!r} precedes "
                          "this output in the conversation")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


# -- scalars --------------------------------------------------------------


def _need_str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", "is required: a string")
    return value


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
