"""How a model family writes tool calls, and which family a chat template is.

A call is always the JSON object ``{"name": NAME, "<args_key>": {...}}``;
families differ in the text around the calls:

    family   marker          calls laid out as                          args_key
    hermes   <tool_call>     <tool_call>\\n{call}\\n</tool_call>, "\\n" between  arguments
    generic  <tool_call>     as hermes; the tools go into the system turn      arguments
    llama3   (none)          {call} at the very start, "; " between            parameters
    mistral  [TOOL_CALLS]    [TOOL_CALLS][{call}, {call}]                      arguments

gpt-oss (``harmony``) is not of that shape: its output is a sequence of
messages, each a header and a body,

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant
    <|channel|>final<|message|>ANSWER                      (then <|return|>, an EOS)
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}  (then <|call|>)

(the recipient may also come before the channel: `` to=functions.NAME<|channel|>
commentary json<|message|>``, as the chat template renders past calls). One call
a turn: ``<|call|>`` ends the output. ``HARMONY_TOKENS`` are the markers; in
gpt-oss's tokenizer each is one special token, as Mistral's ``[TOOL_CALLS]`` is
in its own: ``special`` lists them, so that the detokenizer keeps them in the
text (``marker_tokens``) and the grammar names them by token id.

``detect_format`` reads the chat template's text: ``<|channel|>`` with
``to=functions.`` -> harmony, ``<tool_call>`` -> hermes,
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
    special: tuple[str, ...] = ()        # markers that may be one special token each

    @property
    def harmony(self) -> bool:
        return self.name == "harmony"

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (compact JSON, name first)."""
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON) as a whole assistant turn writes them (harmony:
        one call, the turn's last message, as the model writes it)."""
        if self.harmony:
            if len(calls) != 1:
                raise ValueError("a harmony turn makes exactly one call")
            name, arguments = calls[0]
            return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"
        return self.open + self.first + self.between.join(self.call_text(n, a) for n, a in calls) + self.last


HERMES = ToolFormat("hermes", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")
GENERIC = ToolFormat("generic", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>",
                     in_template=False)
LLAMA3 = ToolFormat("llama3", "", "", "; ", "", args_key="parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "[", ", ", "]", special=("[TOOL_CALLS]",))
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# open: the recipient that makes a message a call
HARMONY = ToolFormat("harmony", "to=functions.", "", "", "", special=HARMONY_TOKENS)

FORMATS = {f.name: f for f in (HERMES, GENERIC, LLAMA3, MISTRAL, HARMONY)}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The family of ``chat_template`` (its text), generic when it has no tool support."""
    text = chat_template or ""
    if is_harmony(text):
        return HARMONY
    if "tools" not in text:
        return GENERIC
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3
    return GENERIC


def is_harmony(chat_template: str | None) -> bool:
    """Whether the template writes OpenAI's harmony format (gpt-oss): then every chat
    answer is channels, parsed whether or not the request has tools."""
    text = chat_template or ""
    return "<|channel|>" in text and "<|message|>" in text


def marker_tokens(fmt: ToolFormat, tokenizer: Any) -> dict[str, int]:
    """``fmt``'s markers that are one special token in ``tokenizer``: marker -> id.
    The detokenizer drops special tokens from the text; these must stay in it, and the
    grammar must ask for the token (a special token is never allowed as text)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special.update(i for i, tok in added.items() if getattr(tok, "special", False))
    by_text = {str(getattr(tok, "content", tok)): i for i, tok in added.items()}
    out: dict[str, int] = {}
    for marker in fmt.special:
        i = by_text.get(marker)
        if i is not None and i in special:
            out[marker] = i
    return out


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


def one_call_per_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Harmony's template renders one call per assistant message (``tool_calls[0]``) and
    names a tool result after the last call before it: an assistant message with k
    calls becomes k messages, each followed by its own result when the results come
    right after it."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        results: dict[str, dict[str, Any]] = {}
        while j < len(messages) and messages[j]["role"] == "tool":
            results.setdefault(messages[j]["tool_call_id"], messages[j])
            j += 1
        if len(results) != j - i - 1:         # a call id answered twice: keep the order as sent
            results, j = {}, i + 1
        for k, call in enumerate(calls):
            out.append(dict(m, content=m["content"] if k == 0 else "", tool_calls=[call]))
            if call["id"] in results:
                out.append(results.pop(call["id"]))
        out.extend(results.values())          # results of an earlier message's calls
        i = j
    return out


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
