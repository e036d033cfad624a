"""Output text -> content, reasoning and tool-call deltas, as tokens arrive.

``OutputParser.feed`` takes each new piece of text once and moves a small state
machine over it; nothing is re-parsed from the start:

    REASON   inside <think>...</think> (when the model reasons): reasoning text
    TEXT     answer text, watched for the format's marker (a suffix that may
             be the marker's start is held back until it is decided)
    HEAD     a call's '{"name": "N", "arguments": ' (at most MAX_HEAD chars)
    ARGS     the arguments JSON, passed on as fragments while its depth is tracked
    TAIL     the text after a call's arguments: its closing brace, the format's
             separators; a '{' there starts the next call

Under the tools' grammar the calls are always well formed, so the argument
fragments of a call concatenated are exactly its arguments JSON.

Harmony (gpt-oss, reasoning mode "harmony") has states of its own:

    H_HEAD   a message's header, up to its <|message|> (at most MAX_HEAD chars):
             its channel and recipient decide what the body is
    H_BODY   the body, up to the marker that ends it (<|end|>, <|call|>,
             <|return|>, or a <|start|> that opens the next message): analysis ->
             reasoning; final and commentary without a recipient -> content;
             a recipient ``functions.NAME`` -> a call, the body its arguments
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from jitney.scheduler.api.tools.formats import ToolFormat

MAX_HEAD = 256
_H_MESSAGE = "<|message|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_H_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_H_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_-]{1,64})(?![A-Za-z0-9_-])")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCallDelta:
    index: int
    id: str = ""          # set (with name) in a call's first delta only
    name: str = ""
    arguments: str = ""


@dataclass
class Deltas:
    """What one piece of text adds."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class OutputParser:
    """One choice's output. ``fmt`` None: no calls are parsed (tool_choice none, or
    no tools); ``reasoning``: the output starts with a reasoning block (the prompt
    opened <think>) or may start with one ("maybe": a leading <think> opens it);
    "harmony": the output is harmony messages (then ``fmt``, if set, is HARMONY)."""

    def __init__(self, fmt: ToolFormat | None, reasoning: str = "off") -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self.content = ""
        self.reasoning = ""
        if reasoning == "harmony" and fmt is not None and not fmt.harmony:
            raise ValueError(f"harmony output cannot carry {fmt.name} calls")
        self._state = {"on": "REASON", "maybe": "START", "harmony": "H_HEAD"}.get(reasoning, "TEXT")
        self._body = ""            # H_BODY: reasoning, content or call
        self._skip_space = False
        self._buf = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False      # TEXT: a marker-less format saw non-space text

    def feed(self, text: str) -> Deltas:
        out = Deltas()
        self._buf += text
        while self._step(out):
            pass
        self.content += out.content
        self.reasoning += out.reasoning
        return out

    def finish(self) -> Deltas:
        """The end of the output: held-back text is what it is."""
        out = Deltas()
        if self._state in ("TEXT", "START", "H_HEAD"):
            out.content, self._buf = self._buf, ""
        elif self._state == "REASON":
            out.reasoning, self._buf = self._buf, ""
        elif self._state == "H_BODY":
            self._body_text(out, self._buf)
            self._buf = ""
        self.content += out.content
        self.reasoning += out.reasoning
        return out

    # -- the states: each returns whether it made progress
    def _step(self, out: Deltas) -> bool:
        if self._skip_space:        # the space after </think>, whichever piece it comes in
            self._buf = self._buf.lstrip()
            self._skip_space = not self._buf
        if not self._buf:
            return False
        return getattr(self, f"_{self._state.lower()}")(out)  # type: ignore[no-any-return]

    def _start(self, out: Deltas) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if THINK_OPEN.startswith(stripped[:len(THINK_OPEN)]) and len(stripped) < len(THINK_OPEN):
            return False
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN):]
            self._state = "REASON"
        else:
            self._state = "TEXT"
        return True

    def _reason(self, out: Deltas) -> bool:
        at = self._buf.find(THINK_CLOSE)
        if at >= 0:
            out.reasoning += self._buf[:at]
            self._buf = self._buf[at + len(THINK_CLOSE):]
            self._state, self._skip_space = "TEXT", True
            return True
        keep = _held_prefix(self._buf, THINK_CLOSE)
        out.reasoning += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _text(self, out: Deltas) -> bool:
        fmt = self.fmt
        if fmt is None:
            out.content, self._buf = out.content + self._buf, ""
            return False
        if not fmt.open:          # calls only at the start of the answer
            if self._started:
                out.content, self._buf = out.content + self._buf, ""
                return False
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            if stripped.startswith("{"):
                self._buf, self._state = stripped, "HEAD"
            else:
                self._started = True
            return True
        at = self._buf.find(fmt.open)
        if at >= 0:
            out.content += self._buf[:at]
            self._buf = self._buf[at + len(fmt.open):]
            self._state = "TAIL"        # the first call starts at its '{'
            return True
        keep = _held_prefix(self._buf, fmt.open)
        out.content += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _head(self, out: Deltas) -> bool:
        match = _HEAD.match(self._buf)
        if match is None:
            if len(self._buf) > MAX_HEAD:     # not a call after all (only without the grammar)
                out.content, self._buf, self._state = out.content + self._buf, "", "TEXT"
                self._started = True
                return True
            return False
        call = ParsedCall(new_call_id(), match.group(1))
        self.calls.append(call)
        out.calls.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
        self._buf = self._buf[match.end():]
        self._depth, self._in_string, self._escape = 0, False, False
        self._state = "ARGS"
        return True

    def _args(self, out: Deltas) -> bool:
        end = None
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = self._buf if end is None else self._buf[:end]
        self._buf = "" if end is None else self._buf[end:]
        if piece:
            self._add_arguments(out, piece)
        if end is not None:
            self._state = "TAIL"
            self._buf = self._buf[1:] if self._buf.startswith("}") else self._buf   # the call's own brace
            return True
        return False

    def _h_head(self, out: Deltas) -> bool:
        at = self._buf.find(_H_MESSAGE)
        if at < 0:
            if len(self._buf) > MAX_HEAD:     # no header after all (only without the grammar)
                out.content, self._buf = out.content + self._buf, ""
                self._state, self._body = "H_BODY", "content"
                return True
            return False
        head, self._buf = self._buf[:at], self._buf[at + len(_H_MESSAGE):]
        channel = _H_CHANNEL.search(head)
        recipient = _H_RECIPIENT.search(head)
        if recipient is not None and self.fmt is not None:
            call = ParsedCall(new_call_id(), recipient.group(1))
            self.calls.append(call)
            out.calls.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
            self._body = "call"
        elif channel is not None and channel.group(1) == "analysis":
            self._body = "reasoning"
        else:
            self._body = "content"
        self._state = "H_BODY"
        return True

    def _h_body(self, out: Deltas) -> bool:
        ends = [(at, m) for m in _H_ENDS if (at := self._buf.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._body_text(out, self._buf[:at])
            # <|start|> belongs to the next header; the other markers end this message
            self._buf = self._buf[at if marker == "<|start|>" else at + len(marker):]
            self._state = "H_HEAD"
            return True
        keep = max(_held_prefix(self._buf, m) for m in _H_ENDS)
        self._body_text(out, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _body_text(self, out: Deltas, piece: str) -> None:
        if not piece:
            return
        if self._body == "reasoning":
            out.reasoning += piece
        elif self._body == "content":
            out.content += piece
        else:
            self._add_arguments(out, piece)

    def _add_arguments(self, out: Deltas, piece: str) -> None:
        """The last call's arguments grow by ``piece``: one delta per call per feed."""
        call = self.calls[-1]
        call.arguments += piece
        index = len(self.calls) - 1
        if out.calls and out.calls[-1].index == index:
            out.calls[-1].arguments += piece
        else:
            out.calls.append(ToolCallDelta(index, arguments=piece))

    def _tail(self, out: Deltas) -> bool:
        at = self._buf.find("{")
        if at < 0:
            self._buf = ""
            return False
        self._buf, self._state = self._buf[at:], "HEAD"
        return True
