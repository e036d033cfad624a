"""Whitespace outside JSON strings, as compact JSON has none: the check of
structured outputs (tests/scheduler/test_grammar_json.py on the masks,
tests/e2e/test_e2e_structured.py on a real server's outputs)."""

from __future__ import annotations


def free_whitespace(text: str) -> list[tuple[int, str]]:
    """Whitespace runs outside JSON strings other than the single space after ',' or ':'
    (offset, run): none in compact JSON. ``text`` may be a prefix of a document."""
    state = WhitespaceScan()
    return state.feed(text)


class WhitespaceScan:
    """free_whitespace, fed piece by piece (a prefix once, then each candidate token)."""

    __slots__ = ("in_string", "escaped", "prev", "run", "offset")

    def __init__(self) -> None:
        self.in_string = self.escaped = False
        self.prev, self.run, self.offset = "", "", 0

    def copy(self) -> WhitespaceScan:
        other = WhitespaceScan()
        other.in_string, other.escaped, other.prev, other.run, other.offset = (
            self.in_string, self.escaped, self.prev, self.run, self.offset)
        return other

    def feed(self, text: str) -> list[tuple[int, str]]:
        bad = []
        for c in text:
            self.offset += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string, self.prev = False, c
                continue
            if c in " \t\n\r":
                self.run += c
                if self.run != " " or self.prev not in (",", ":"):
                    bad.append((self.offset - len(self.run), self.run))
                continue
            self.run = ""
            self.in_string = c == '"'
            self.prev = c
        return bad
