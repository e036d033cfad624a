"""A request's tools, checked: ``tool_request`` reads GenerationParams'
tools / tool_choice / parallel_tool_calls (and the chat's tool turns) and
raises InvalidRequestError naming the proto field (``params.tools[1].parameters``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jitney.scheduler.core.request import InvalidRequestError
from jitney.v1 import generation_pb2 as pb

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")       # OpenAI's rule for function names
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 65_536
CHOICES = ("auto", "none", "required", "function")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]        # a JSON Schema of the arguments object

    def openai(self) -> dict[str, Any]:
        """As OpenAI's (and transformers' chat templates') ``tools`` entry."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """``choice``: auto | none | required | function (then ``function`` names the tool).
    ``callable`` is the tools the grammar allows: all, or the named one."""

    tools: tuple[ToolSpec, ...]
    choice: str
    function: str
    parallel: bool

    @property
    def callable(self) -> tuple[ToolSpec, ...]:
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools if self.choice != "none" else ()

    @property
    def forced(self) -> bool:
        """The output must be calls from its first token."""
        return self.choice in ("required", "function")


def tool_request(params: pb.GenerationParams) -> ToolRequest | None:
    """The request's tools, or None when it has none (then tool_choice must be unset)."""
    if not params.tools:
        if params.tool_choice not in ("", "none") or params.tool_choice_function:
            raise InvalidRequestError("params.tool_choice", "needs tools")
        return None
    if params.WhichOneof("prompt") != "chat":
        raise InvalidRequestError("params.tools", "need a chat prompt")
    if len(params.tools) > MAX_TOOLS:
        raise InvalidRequestError("params.tools", f"has {len(params.tools)} tools, more than the limit {MAX_TOOLS}")
    tools: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(params.tools):
        where = f"params.tools[{i}]"
        if not NAME_RE.fullmatch(tool.name):
            raise InvalidRequestError(f"{where}.name", f"must be 1 to 64 characters of A-Z, a-z, 0-9, _ "
                                                       f"and -, got {tool.name[:70]!r}")
        if tool.name in seen:
            raise InvalidRequestError(f"{where}.name", f"{tool.name!r} is defined twice")
        seen.add(tool.name)
        tools.append(ToolSpec(tool.name, tool.description, _parameters(tool.parameters, f"{where}.parameters")))
    choice = params.tool_choice or "auto"
    if choice not in CHOICES:
        raise InvalidRequestError("params.tool_choice", f"must be one of {', '.join(CHOICES)}, got {choice[:32]!r}")
    function = params.tool_choice_function
    if choice == "function":
        if function not in seen:
            raise InvalidRequestError("params.tool_choice_function",
                                      f"{function[:70]!r} is not one of the request's tools")
    elif function:
        raise InvalidRequestError("params.tool_choice_function", "is only allowed with tool_choice function")
    parallel = params.parallel_tool_calls if params.HasField("parallel_tool_calls") else True
    return ToolRequest(tuple(tools), choice, function, parallel)


def _parameters(text: str, field: str) -> dict[str, Any]:
    if not text:
        return {"type": "object", "properties": {}}
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequestError(field, f"has {len(text)} characters, more than the limit {MAX_SCHEMA_CHARS}")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(field, f"not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "must be a JSON Schema object")
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(field, f"must describe an object (type \"object\"), got type {kind!r}")
    return schema


def check_tool_turns(messages: Any, field: str) -> None:
    """Tool turns name a call an earlier assistant turn made; call ids are unique and
    their arguments JSON objects; only tool turns carry a tool_call_id."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls", "only assistant messages make tool calls")
        for j, call in enumerate(m.tool_calls):
            if not call.id:
                raise InvalidRequestError(f"{where}.tool_calls[{j}].id", "must not be empty")
            if call.id in ids:
                raise InvalidRequestError(f"{where}.tool_calls[{j}].id", f"{call.id[:64]!r} is used twice")
            ids.add(call.id)
            if not NAME_RE.fullmatch(call.name):
                raise InvalidRequestError(f"{where}.tool_calls[{j}].name", "must be a function name")
            try:
                args = json.loads(call.arguments or "{}")
            except ValueError as exc:
                raise InvalidRequestError(f"{where}.tool_calls[{j}].arguments", f"not JSON: {exc}") from None
            if not isinstance(args, dict):
                raise InvalidRequestError(f"{where}.tool_calls[{j}].arguments", "must be a JSON object")
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequestError(f"{where}.tool_call_id", "is required in a tool message")
            if m.tool_call_id not in ids:
                raise InvalidRequestError(f"{where}.tool_call_id",
                                          f"{m.tool_call_id[:64]!r} names no tool call of an earlier assistant message")
        elif m.tool_call_id:
            raise InvalidRequestError(f"{where}.tool_call_id", "is only allowed in a tool message")
