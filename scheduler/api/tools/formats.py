"""How a model family writes tool calls, and which family a chat template is.

A call is always the JSON object ``{"name": NAME, "<args_key>": {...}}``;
families differ in the text around the calls:

    family   marker          calls laid out as                          args_key
    hermes   <tool_call>     <tool_call>\\n{call}\\n</tool_call>, "\\n" between  arguments
    generic  <tool_call>     as hermes; the tools go into the system turn      arguments
    llama3   (none)          {call} at the very start, "; " between            parameters
    mistral  [TOOL_CALLS]    [TOOL_CALLS][{call}, {call}]                      arguments

``detect_format`` reads the chat template's text: ``<tool_call>`` -> hermes,
``[TOOL_CALLS]`` -> mistral, ``<|python_tag|>`` or an ``ipython`` role ->
llama3; a template that never reads ``tools`` (SmolLM2's) -> generic. The
server's ``--tool-call-parser`` overrides it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jitney.scheduler.api.tools.spec import ToolSpec


@dataclass(frozen=True)
class ToolFormat:
    """``open``: the text that starts the calls (empty: calls start the output);
    ``first`` / ``between`` / ``last``: the text after ``open`` before the first
    call, between two calls, and after the last one. ``in_template``: the chat
    template renders ``tools=`` itself (else the system turn gets ``system_text``)."""

    name: str
    open: str
    first: str
    between: str
    last: str
    args_key: str = "arguments"
    in_template: bool = True

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (compact JSON, name first)."""
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON) as a whole assistant turn writes them."""
        return self.open + self.first + self.between.join(self.call_text(n, a) for n, a in calls) + self.last


HERMES = ToolFormat("hermes", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")
GENERIC = ToolFormat("generic", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>",
                     in_template=False)
LLAMA3 = ToolFormat("llama3", "", "", "; ", "", args_key="parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "[", ", ", "]")

FORMATS = {f.name: f for f in (HERMES, GENERIC, LLAMA3, MISTRAL)}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The family of ``chat_template`` (its text), generic when it has no tool support."""
    text = chat_template or ""
    if "tools" not in text:
        return GENERIC
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3
    return GENERIC


def format_named(name: str, chat_template: str | None) -> ToolFormat:
    """``--tool-call-parser``'s value: a family name, or "auto" (detected)."""
    if name == "auto":
        return detect_format(chat_template)
    if name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be auto or one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def system_text(tools: tuple[ToolSpec, ...], fmt: ToolFormat) -> str:
    """The generic format's tool instructions, for the system turn."""
    lines = ["You may call functions. They are, as JSON:"]
    lines += [json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools]
    lines.append("To call one, answer with " + fmt.calls_text([("<name>", "{<arguments>}")])
                 + " (one block per call); the function's result comes back in a message of "
                   "its own.")
    return "\n".join(lines)


def template_message(role: str, content: str, calls: list[tuple[str, str, str]], tool_call_id: str,
                     fmt: ToolFormat) -> dict[str, Any]:
    """One chat message for the template. Assistant calls (id, name, arguments JSON) get
    transformers' shape (arguments as a dict); for a template without tool support they
    are written into the content in the generic format, and a tool result becomes a
    user turn wrapped in <tool_response>."""
    if not fmt.in_template:
        if calls:
            text = fmt.calls_text([(n, a) for _, n, a in calls])
            return {"role": role, "content": f"{content}\n{text}" if content else text}
        if role == "tool":
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {"role": role, "content": content}
    # "" rather than None without text: templates do string tests on content (Qwen3's "in")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = [{"id": i, "type": "function",
                              "function": {"name": n, "arguments": json.loads(a or "{}")}}
                             for i, n, a in calls]
    if role == "tool":
        out["tool_call_id"] = tool_call_id
    return out
