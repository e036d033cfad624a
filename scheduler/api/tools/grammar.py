"""The llguidance (Lark) grammar that holds a request's tool calls to its tools'
schemas.

    forced (required, a named tool):  OPEN FIRST call (BETWEEN call)* LAST
    auto:                              TEXT | PRE FIRST call (BETWEEN call)* LAST

``TEXT`` is free text that never contains the format's marker; ``PRE`` is free
text that ends at the marker's first occurrence, so an unconstrained start can
still only produce schema-valid calls once it writes the marker. A format with
no marker (Llama 3) calls only at the start: its free text may not begin with
``{``. ``parallel`` false: exactly one call. Each call is
``{"name": "N", "arguments": ARGS}`` with ARGS a ``%json`` sub-grammar of the
tool's schema, compact and with closed objects (as response_format's strict
JSON, scheduler/core/grammar.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jitney.scheduler.api.tools.formats import ToolFormat
from jitney.scheduler.api.tools.spec import ToolRequest
from jitney.scheduler.core.grammar import COMPACT_JSON_OPTIONS, LENIENT_JSON_OPTIONS, close_objects


def _literal(text: str) -> str:
    return json.dumps(text)


def _regex(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def tool_grammar(fmt: ToolFormat, req: ToolRequest, reasoning: str = "off") -> str:
    """The Lark text for ``req`` (choice auto, required or function) in ``fmt``.
    ``reasoning`` (OutputParser's mode): "on", the output starts inside a reasoning
    block, free up to its ``</think>``; "maybe", it may start with one; the calls'
    grammar applies after it."""
    tools = req.callable
    rules = _start(reasoning)
    calls = ["calls:"]
    if fmt.first:
        calls.append(_literal(fmt.first))
    calls.append("call")
    if req.parallel:
        calls.append(f"({_literal(fmt.between)} call)*")
    if fmt.last:
        calls.append(_literal(fmt.last))
    if req.forced:
        rules.append(f"main: {_literal(fmt.open)} calls" if fmt.open else "main: calls")
    elif fmt.open:
        mark = _regex(fmt.open)
        rules.append("main: TEXT | PRE calls")
        rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*{mark}.*)/")
        rules.append(f"PRE: /(?s:.*){mark}/ & ~/(?s:.*{mark}.+)/")
    else:
        rules.append("main: TEXT | calls")
        rules.append("TEXT: /(?s:.+)/ & ~/(?s:\\s*\\{.*)/")
    rules.append(" ".join(calls))
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = f'{{"name": {json.dumps(tool.name)}, "{fmt.args_key}": '
        rules.append(f"call_{i}: {_literal(head)} args_{i} \"}}\"")
        schema = close_objects(tool.parameters)
        schema["x-guidance"] = dict(COMPACT_JSON_OPTIONS)
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"


def _start(reasoning: str) -> list[str]:
    """The grammar's head: ``start`` is ``main``, after a reasoning block where the
    model reasons ("on": the output starts inside it, free up to its ``</think>``;
    "maybe": it may start with one)."""
    rules = ["%llguidance {}"]
    if reasoning not in ("on", "maybe"):
        return rules + ["start: main"]
    head = "" if reasoning == "on" else "<think>"
    rules.append("start: REASON main" if reasoning == "on" else "start: REASON? main")
    rules.append(rf"REASON: /{_regex(head)}(?s:.*)<\/think>[ \n]*/ & ~/(?s:.*<\/think>.*<\/think>.*)/")
    return rules


def reasoned_json_grammar(schema: dict[str, Any] | None, lenient: bool, reasoning: str) -> str:
    """A JSON response format (``schema`` None: any object) that applies after the
    reasoning block: as scheduler/core/grammar.py compiles it, compact and closed
    unless ``lenient``."""
    if schema is None:
        schema = {"type": "object"}
    elif not lenient:
        schema = close_objects(schema)
    schema = dict(schema, **{"x-guidance": dict(LENIENT_JSON_OPTIONS if lenient else COMPACT_JSON_OPTIONS)})
    return "\n".join(_start(reasoning) + [f"main: %json {json.dumps(schema)}"]) + "\n"
