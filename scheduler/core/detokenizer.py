"""Incremental detokenization with stop strings.

Turns a request's output token ids, as they arrive, into text that is safe to
send at once: whole UTF-8 characters only, and never any part of a stop
string.

Decoding uses the prefix/read offset technique (as in vLLM and TGI). Only a
short window of recent tokens is decoded each step, twice:

    window[0:read)   -> prefix text (already emitted)
    window[0:]       -> new text; new_text[len(prefix_text):] is the delta

Decoding the same leading tokens both times keeps tokenizer quirks that act
on the first token of a string (SentencePiece strips its leading '▁') from
eating a space in the middle of the output. Text that ends in U+FFFD is a
character whose bytes are split across byte-level tokens: the pending tokens
are emitted up to the last character boundary among them, and the rest is
held back until later tokens complete the character.

Stop strings are matched on the produced text, across token boundaries. Text
that could be the start of a stop string is held back (at most
``max(len(s) for s in stop) - 1`` characters) until it is known not to be.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# A transformers tokenizer (PreTrainedTokenizerBase); Any because its decode
# signature is too broad for a useful Protocol.
Tokenizer = Any

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the output: context for the first token.
_PROMPT_CONTEXT_TOKENS = 5
# Pending tokens with no character boundary among them are invalid bytes
# once there are more than this many; all but the last _MAX_CHAR_TOKENS are
# then emitted as they decode (U+FFFD). A UTF-8 character is at most 4
# bytes, so only its last 3 tokens can still be waiting for the rest.
_MAX_PENDING_TOKENS = 8
_MAX_CHAR_TOKENS = 3


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one ``push`` produced.

    ``text`` is new text to send now (may be empty). ``stopped`` is True once
    a stop string matched; ``text`` then ends just before the stop string.
    """

    text: str
    stopped: bool


class StopStringMatcher:
    """Finds stop strings in a stream of text pieces, holding back text that
    may be the beginning of one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = stop
        self._held = ""
        self.matched: str | None = None   # the stop string that matched, once one has

    def feed(self, text: str, match: bool = True) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit, whether a stop matched).

        On a match the returned text ends just before the first stop string
        to complete, and everything after it is discarded. With ``match``
        False (before min_tokens) the text passes unmatched and unheld.
        """
        if not match:
            out, self._held = self._held + text, ""
            return out, False
        buf = self._held + text
        cut = self._earliest_stop(buf)
        if cut is not None:
            self._held = ""
            return buf[:cut], True
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back text (the stream ended without a stop)."""
        held, self._held = self._held, ""
        return held

    def _earliest_stop(self, buf: str) -> int | None:
        """Start of the stop string that completes first in ``buf`` (ties:
        the longest), as if the text had arrived one character at a time."""
        found = [(i + len(s), i, s) for s in self._stop if (i := buf.find(s)) >= 0]
        if not found:
            return None
        _, start, self.matched = min(found)
        return start

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of
        some stop string (0 if none)."""
        best = 0
        for s in self._stop:
            start = max(len(buf) - (len(s) - 1), 0)
            j = buf.find(s[0], start)
            # The first (leftmost) start that fits is this stop's longest.
            while j >= 0 and len(buf) - j > best:
                if s.startswith(buf[j:]):
                    best = len(buf) - j
                    break
                j = buf.find(s[0], j + 1)
        return best


class IncrementalDetokenizer:
    """Detokenizes one request's output, token by token.

    ``push`` returns the text that can be sent now; ``flush`` returns what is
    still held back once the request finishes for any reason other than a
    stop string. Without stop strings the concatenation of everything
    returned equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``
    (for SentencePiece-style tokenizers, except that a leading space of the
    first output token is kept when the prompt is not empty).

    Decisions:
      * An incomplete UTF-8 tail left at ``flush`` is emitted as U+FFFD, as
        ``tokenizer.decode`` of the whole output would: the client sees that
        bytes were lost, and the text is still valid UTF-8.
      * Special tokens are dropped before decoding when
        ``skip_special_tokens`` is set, so they never grow the window; those in
        ``keep_special`` (a tool format's markers) stay, as their text.
      * Decoding never cleans up tokenization spaces: that clean-up is not
        local to a window.
      * When several stop strings match, the one that completes first wins
        (as if text arrived one character at a time). A stop can still match
        in the text ``flush`` releases; ``stopped`` then turns True.
      * After a stop or a flush the detokenizer is finished: ``push`` returns
        empty updates.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        keep_special: frozenset[int] = frozenset(),
    ) -> None:
        self._tokenizer = tokenizer
        # Dropped here, before decoding: with ids to keep, decode must not drop them itself.
        self._special_ids = _special_token_ids(tokenizer) - keep_special if skip_special_tokens else frozenset()
        self._skip_special = skip_special_tokens and not keep_special
        self._matcher = StopStringMatcher(stop)
        self._window = self._prompt_context(prompt_token_ids)
        self._read = len(self._window)  # window[0:read) decodes to emitted text
        self._emitted: list[str] = []
        self._stopped = False
        self._finished = False

    @property
    def full_text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched (Anthropic's ``stop_sequence``), else None."""
        return self._matcher.matched if self._stopped else None

    def push(self, token_ids: list[int], match_stop: bool = True) -> DetokenizerUpdate:
        """Add newly sampled token ids; return the text to send now.
        ``match_stop`` False: stop strings are not looked for in this text."""
        if self._finished:
            return DetokenizerUpdate("", self._stopped)
        self._window.extend(t for t in token_ids if t not in self._special_ids)
        delta = self._decode_delta(final=False)
        text, self._stopped = self._matcher.feed(delta, match_stop) if delta else ("", False)
        self._finished = self._stopped
        return DetokenizerUpdate(self._record(text), self._stopped)

    def flush(self) -> str:
        """Finish the request (not by a stop string): return the held-back
        text, including an incomplete UTF-8 tail as U+FFFD."""
        if self._finished:
            return ""
        self._finished = True
        text, self._stopped = self._matcher.feed(self._decode_delta(final=True))
        if not self._stopped:
            text += self._matcher.flush()
        return self._record(text)

    def _decode_delta(self, final: bool) -> str:
        """New text of the pending tokens, up to the last character boundary
        (all of it when ``final``); moves the offsets past what it returns."""
        if self._read == len(self._window):
            return ""
        prefix_text = self._decode(self._window[: self._read])
        if final:
            end, text = len(self._window), self._decode(self._window)
        else:
            found = self._complete_end(len(prefix_text))
            if found is None:
                return ""
            end, text = found
        # The tokens emitted now are the next window's prefix.
        del self._window[: self._read]
        self._read = end - self._read
        return text[len(prefix_text):]

    def _complete_end(self, prefix_len: int) -> tuple[int, str] | None:
        """The longest window[0:end) that decodes to new whole characters, as
        (end, its text); None if there is none yet."""
        for end in range(len(self._window), self._read, -1):
            text = self._decode(self._window[:end])
            if len(text) > prefix_len and not text.endswith(_REPLACEMENT):
                return end, text
        if len(self._window) - self._read > _MAX_PENDING_TOKENS:
            end = len(self._window) - _MAX_CHAR_TOKENS  # invalid bytes: let go
            return end, self._decode(self._window[:end])
        return None

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )
        return text

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The last few prompt tokens, or none if they end mid-character
        (the output would then start with the rest of a prompt character)."""
        ids = [t for t in prompt_token_ids if t not in self._special_ids]
        context = ids[-_PROMPT_CONTEXT_TOKENS:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            return []
        return context

    def _record(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text


def _special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {})
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: character -> the byte it stands for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")     # SentencePiece's byte tokens


class TokenTexts:
    """Each token's own text and bytes (for logprobs), cached: at most a
    vocabulary's worth, and the same few thousand ids recur.

    The text is the token decoded alone. A token holding part of a UTF-8
    character decodes to U+FFFD: its bytes are then read from its vocabulary
    entry (byte-level BPE, or SentencePiece's <0xNN>), so that a client can
    join the pieces up; otherwise they are the text's UTF-8.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> str:
        return self.entry(token)[0]

    def many(self, tokens: Iterable[int]) -> list[str]:
        return [self(t) for t in tokens]

    def raw(self, token: int) -> list[int]:
        return self.entry(token)[1]

    def entry(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            text = str(self.tokenizer.decode([token]))
            raw = self._raw_bytes(token) if "\ufffd" in text else None
            got = self._cache[token] = (text, list(raw if raw is not None else text.encode()))
        return got

    def _raw_bytes(self, token: int) -> bytes | None:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token)
        except Exception:       # a tokenizer without a vocabulary view
            return None
        if not isinstance(piece, str) or not piece:
            return None
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return None
