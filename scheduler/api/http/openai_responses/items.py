"""A Responses API request's input items, normalized, and a conversation of
them as chat completions messages.

Normalized items (what the store keeps, in order, as the conversation):
    {"type": "message", "role": user|assistant|system, "content": [{"type": "input_text"|"output_text", "text"}]}
    {"type": "function_call", "call_id", "name", "arguments"}      (+ "id", "status" on output items)
    {"type": "function_call_output", "call_id", "output"}
    {"type": "reasoning", ...}                                      (an output item; not re-rendered)

Every item has an ``id`` (what ``GET /v1/responses/{id}/input_items`` pages
by): the client's, checked, or a new one (``msg_``, ``fc_``, ``fco_`` + hex).

Decisions:
  * Role ``developer`` is ``system``. Consecutive ``function_call`` items are
    one assistant turn with parallel ``tool_calls`` (joined to the assistant
    message right before them); each ``function_call_output`` is a ``tool``
    turn and must answer a call earlier in the conversation.
  * Past reasoning items are kept in the conversation but not rendered
    (chat templates drop the reasoning of earlier turns).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from jitney.scheduler.api.http.openai.protocol import APIError

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
MAX_ID_CHARS = 128


def bad(param: str, message: str, code: str | None = None) -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, f"{param}: {message}", param=param, code=code)


def need_str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", "is required: a string")
    return value


def parse_input(value: Any) -> list[dict[str, Any]]:
    """``input``, normalized (see the module docstring)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}],
                 "id": _item_id({}, "message", "input")}]
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
            items.append({"type": "function_call", "call_id": need_str(item, "call_id", where),
                          "name": need_str(item, "name", where),
                          "arguments": need_str(item, "arguments", where)})
        elif kind == "function_call_output":
            items.append({"type": "function_call_output", "call_id": need_str(item, "call_id", where),
                          "output": _output_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            items.append(dict(item))
        elif isinstance(kind, str):
            raise bad(f"{where}.type", f"{kind[:32]!r} is not supported by Jitney (message, "
                      "function_call, function_call_output, reasoning)", code="unsupported_value")
        else:
            raise bad(f"{where}.type", "is required: a string")
        items[-1]["id"] = _item_id(item, kind, where)
    return items


def _item_id(item: Mapping[str, Any], kind: str, where: str) -> str:
    """The item's own id when it has one (a non-empty printable string), else a new one."""
    given = item.get("id")
    if given is None:
        return f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"
    if not isinstance(given, str) or not given or len(given) > MAX_ID_CHARS or not given.isprintable():
        raise bad(f"{where}.id", f"must be a non-empty printable string of at most {MAX_ID_CHARS} characters")
    return given


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
            parts.append({"type": part["type"], "text": need_str(part, "text", pwhere)})
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
            texts.append(need_str(part, "text", f"{where}[{j}]"))
        return "\n".join(texts)
    raise bad(where, "is required: a string or a list of input_text parts")


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
