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

A marker that is one special token of the tokenizer (``tokens``: marker -> id,
formats.marker_tokens) is written ``<[id]>``: llguidance never lets a special
token stand for text, so the literal would ask for the marker spelled out in
ordinary tokens, which a model does not write. The free text around it still
may not spell the marker, so that the marker in the output text is the token.

Harmony (gpt-oss):

    forced:  (analysis END)* call
    auto:    (message END)* (message | call)
    message: <|channel|> (analysis | final | commentary) <|message|> TEXT?
    call:    <|channel|>commentary to=functions.N [ <|constrain|>]json<|message|> ARGS
             | to=functions.N<|channel|>commentary [<|constrain|>]json<|message|> ARGS

END is ``<|end|><|start|>assistant``; TEXT never holds a marker. A call ends the
grammar (the model's <|call|> is an EOS id), so a turn makes one call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from jitney.scheduler.api.tools.formats import HARMONY_TOKENS, ToolFormat
from jitney.scheduler.api.tools.spec import ToolRequest
from jitney.scheduler.core.grammar import COMPACT_JSON_OPTIONS, close_objects


def _literal(text: str) -> str:
    return json.dumps(text)


def _regex(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def _mark(text: str, tokens: Mapping[str, int]) -> str:
    """``text`` in the grammar: its special token, or the literal."""
    return f"<[{tokens[text]}]>" if text in tokens else _literal(text)


def _args_rule(i: int, schema: dict[str, Any]) -> str:
    schema = close_objects(schema)
    schema["x-guidance"] = dict(COMPACT_JSON_OPTIONS)
    return f"args_{i}: %json {json.dumps(schema)}"


def _harmony_rules(tokens: Mapping[str, int]) -> list[str]:
    """What every harmony grammar shares: the markers, message ends, free text."""
    excluded = "|".join(_regex(m) for m in HARMONY_TOKENS)
    return [f"h_c: {_mark('<|channel|>', tokens)}",
            f"h_m: {_mark('<|message|>', tokens)}",
            f"h_end: {_mark('<|end|>', tokens)} {_mark('<|start|>', tokens)} \"assistant\"",
            f"H_TEXT: /(?s:.+)/ & ~/(?s:.*(?:{excluded}).*)/",
            "h_analysis: h_c \"analysis\" h_m H_TEXT?"]


def harmony_tool_grammar(req: ToolRequest, tokens: Mapping[str, int]) -> str:
    """The Lark text for ``req`` in harmony (module docstring)."""
    rules = ["%llguidance {}"]
    if req.forced:
        rules.append("start: (h_analysis h_end)* call")
    else:
        rules.append("start: (h_message h_end)* (h_message | call)")
        rules.append('h_message: h_c ("analysis" | "final" | "commentary") h_m H_TEXT?')
    rules += _harmony_rules(tokens)
    constrain = _mark("<|constrain|>", tokens)
    rules.append(f'h_json: " " {constrain} "json" h_m | " json" h_m | {constrain} "json" h_m')
    tools = req.callable
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        to = _literal(f"to=functions.{tool.name}")
        rules.append(f'call_{i}: h_c "commentary " {to} h_json args_{i} '
                     f'| " " {to} h_c "commentary" h_json args_{i}')
        rules.append(_args_rule(i, tool.parameters))
    return "\n".join(rules) + "\n"


def tool_grammar(fmt: ToolFormat, req: ToolRequest, reasoning: str = "off",
                 tokens: Mapping[str, int] | None = None) -> str:
    """The Lark text for ``req`` (choice auto, required or function) in ``fmt``.
    ``reasoning`` (OutputParser's mode): "on", the output starts inside a reasoning
    block, free up to its ``</think>``; "maybe", it may start with one; the calls'
    grammar applies after it. ``tokens``: the format's markers that are special
    tokens (marker -> id)."""
    tokens = tokens or {}
    if fmt.harmony:
        return harmony_tool_grammar(req, tokens)
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
        rules.append(f"main: {_mark(fmt.open, tokens)} calls" if fmt.open else "main: calls")
    elif fmt.open in tokens:
        # The marker is one token, which free text cannot be: the lazy switch is the token.
        rules.append(f"main: TEXT | TEXT? {_mark(fmt.open, tokens)} calls")
        rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*{_regex(fmt.open)}.*)/")
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
        rules.append(_args_rule(i, tool.parameters))
    return "\n".join(rules) + "\n"


def _start(reasoning: str, tokens: Mapping[str, int] | None = None) -> list[str]:
    """The grammar's head: ``start`` is ``main``, after a reasoning block where the
    model reasons ("on": the output starts inside it, free up to its ``</think>``;
    "maybe": it may start with one; "harmony": ``main`` is the final channel's body,
    after analysis messages)."""
    rules = ["%llguidance {}"]
    if reasoning == "harmony":
        return rules + ["start: (h_analysis h_end)* h_c \"final\" h_m main"] + _harmony_rules(tokens or {})
    if reasoning not in ("on", "maybe"):
        return rules + ["start: main"]
    head = "" if reasoning == "on" else "<think>"
    rules.append("start: REASON main" if reasoning == "on" else "start: REASON? main")
    rules.append(rf"REASON: /{_regex(head)}(?s:.*)<\/think>[ \n]*/ & ~/(?s:.*<\/think>.*<\/think>.*)/")
    return rules


def reasoned_grammar(answer: str, reasoning: str, tokens: Mapping[str, int] | None = None) -> str:
    """A response format that applies to the answer after the reasoning: ``answer`` is
    its llguidance grammar (core/grammar.py's ``engine_grammar``: Lark text, or a
    TopLevelGrammar JSON of one grammar: a JSON schema, a regex); the result is a
    TopLevelGrammar whose first grammar is the reasoning head and whose ``main`` is
    ``@answer``, the format's grammar unchanged, so its rule names cannot meet ours."""
    if answer.lstrip().startswith("{"):
        inner = json.loads(answer)["grammars"]
        if len(inner) != 1:
            raise ValueError(f"the answer's grammar has {len(inner)} grammars, not one")
        sub = {k: v for k, v in inner[0].items() if v is not None}
    else:
        sub = {"lark_grammar": answer}
    sub["name"] = "answer"
    head = "\n".join(_start(reasoning, tokens) + ["main: @answer"]) + "\n"
    return json.dumps({"grammars": [{"lark_grammar": head}, sub]})
