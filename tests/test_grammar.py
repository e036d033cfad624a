"""Structured output (jitney.scheduler.grammar) with the served tokenizer (SmolLM2's).

The model's logits width is taken wider than the tokenizer (VOCAB) so that the
padding ids are checked too. One event loop and one compiler serve the module.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
from jitney.scheduler.admission import QueueFullError
from jitney.scheduler.grammar import (
    MAX_JSON_WHITESPACE,
    CompiledGrammar,
    GrammarCompiler,
    GrammarCompilerBusyError,
    GrammarMatcher,
    allocate_bitmask,
    bitmask_words,
    close_objects,
    fill_batch,
)
from jitney.scheduler.validation import (
    CONSTRAINED_DEFAULT_MAX_TOKENS,
    InvalidRequestError,
    ModelLimits,
    validate_generation,
)
from jitney.v1 import generation_pb2 as pb

T = TypeVar("T")
PAD = 37          # the model's head is this much wider than the tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(None), cache_root())


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> int:
    return len(tokenizer) + PAD


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def run(loop: asyncio.AbstractEventLoop) -> Callable[[Coroutine[Any, Any, T]], T]:
    return loop.run_until_complete


@pytest.fixture(scope="module")
def compiler(tokenizer: Any, vocab: int) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, vocab)
    yield c
    c.close()


@pytest.fixture(scope="module")
def token_bytes(compiler: GrammarCompiler, tokenizer: Any) -> list[bytes]:
    return [compiler.engine_tokenizer.decode_bytes([i]) for i in range(len(tokenizer))]


@pytest.fixture(scope="module")
def special(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in tokenizer.all_special_ids}
    return ids | {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def schema(s: Any, *, lenient: bool = False) -> pb.ResponseFormat:
    return pb.ResponseFormat(json_schema=json.dumps(s), lenient_json=lenient)


def allowed(m: GrammarMatcher, vocab: int) -> np.ndarray:
    out = allocate_bitmask(1, vocab)[0]
    m.fill_bitmask(out)
    return np.flatnonzero(np.unpackbits(out.view(np.uint8), bitorder="little"))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


EOS = 2   # SmolLM2's <|im_end|>

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "kind": {"enum": ["book", "film", "song"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "author": {"type": "object",
                   "properties": {"name": {"type": "string", "maxLength": 30},
                                  "alive": {"type": "boolean"}},
                   "required": ["name"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "note": {"type": ["string", "null"], "maxLength": 40},
    },
    "required": ["id", "kind", "rating", "author"],
    "additionalProperties": False,
}
NESTED_DOCS = [
    {"id": "AB-123", "kind": "book", "rating": 4.5, "year": 1999,
     "author": {"name": "Zoë \"Z\" Brontë", "alive": False}, "tags": ["a\\b", "x\ty"], "note": None},
    {"id": "XY-000", "kind": "song", "rating": 0, "author": {"name": "山田"}, "note": "é 🙂"},
]


# -- the format kinds ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, text", [
    (schema(NESTED), json.dumps(NESTED_DOCS[0])),
    (pb.ResponseFormat(json_object=True), '{"x": [1, 2.5, {"y": null}], "z": "w"}'),
    (pb.ResponseFormat(regex=r"[0-9]{3}-[a-z]+"), "123-abc"),
    (pb.ResponseFormat(choice=pb.Choice(choices=["red", "green", "a \"q\" \\ é"])), "a \"q\" \\ é"),
    (pb.ResponseFormat(grammar='root ::= "a" b ("," b)*\nb ::= [0-9]+'), "a12,3"),
], ids=["json_schema", "json_object", "regex", "choice", "grammar"])
def test_each_kind_compiles_and_accepts_a_valid_output(compiler: GrammarCompiler, tokenizer: Any, vocab: int,
                                                       run: Any, fmt: pb.ResponseFormat, text: str) -> None:
    g = run(compiler.compile(fmt))
    assert isinstance(g, CompiledGrammar) and g.kind == fmt.WhichOneof("format")
    m = g.new_matcher()
    for t in encode(tokenizer, text):
        assert not m.is_completed() or EOS in allowed(m, vocab)
        assert m.accept_token(t), (text, tokenizer.decode([t]), m.error())
    assert m.is_completed() and EOS in allowed(m, vocab)
    assert not m.is_terminated()
    assert m.accept_token(EOS) and m.is_terminated()
    assert not m.accept_token(EOS)   # nothing after the end


def test_cache_returns_the_compiled_grammar_and_is_bounded(compiler: GrammarCompiler, vocab: int,
                                                           run: Any) -> None:
    fmt = pb.ResponseFormat(regex="cached[0-9]")
    assert run(compiler.compile(fmt)) is run(compiler.compile(fmt))
    small = GrammarCompiler(compiler.engine_tokenizer, vocab, cache_size=2)
    first = run(small.compile(pb.ResponseFormat(regex="a")))
    run(small.compile(pb.ResponseFormat(regex="b")))
    run(small.compile(pb.ResponseFormat(regex="c")))
    assert small.cache_info()["cached"] == 2
    assert run(small.compile(pb.ResponseFormat(regex="a"))) is not first     # evicted, compiled anew
    small.close()


def test_concurrent_compiles_of_one_format_compile_once(compiler: GrammarCompiler, vocab: int, run: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    c = GrammarCompiler(compiler.engine_tokenizer, vocab, max_workers=2)
    calls = []
    build = c._build
    monkeypatch.setattr(c, "_build", lambda key, field: (calls.append(key), time.sleep(0.05), build(key, field))[2])

    async def many() -> list[CompiledGrammar]:
        return await asyncio.gather(*(c.compile(pb.ResponseFormat(regex="once")) for _ in range(5)))

    results = run(many())
    assert len(calls) == 1 and all(r is results[0] for r in results)
    c.close()


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, field, message", [
    (pb.ResponseFormat(json_schema='{"type": "nope"}'), "json_schema", "Invalid type: nope"),
    (schema({"type": "integer", "minimum": 5, "maximum": 1}), "json_schema",
     "minimum (5) is greater than maximum (1)"),
    (schema({"type": "string", "format": "no-such-format"}), "json_schema", "Unknown format"),
    (pb.ResponseFormat(json_schema="{not json"), "json_schema", "not JSON"),
    (pb.ResponseFormat(regex="(["), "regex", "unclosed character class"),
    (pb.ResponseFormat(regex="a{2,1}"), "regex", "invalid repetition count range"),
    (pb.ResponseFormat(grammar="root ::= undefined_rule"), "grammar", "Rule 'undefined_rule' not found"),
    (pb.ResponseFormat(grammar='root ::= "a" ('), "grammar", "Expected ')'"),
    (pb.ResponseFormat(choice=pb.Choice()), "choice.choices", "at least one choice"),
    (pb.ResponseFormat(json_object=False), "json_object", "must be true"),
    (pb.ResponseFormat(), "", "no format is set"),
    (pb.ResponseFormat(regex="a+", lenient_json=True), "lenient_json", "json_schema and json_object only"),
], ids=["bad-type", "unsatisfiable", "unknown-format", "not-json", "bad-regex", "bad-repeat", "ebnf-rule",
        "ebnf-syntax", "empty-choice", "json-object-false", "unset", "lenient-regex"])
def test_invalid_formats_name_the_field_and_carry_the_engines_message(
        compiler: GrammarCompiler, run: Any, fmt: pb.ResponseFormat, field: str, message: str) -> None:
    want = "params.response_format" + (f".{field}" if field else "")
    for _ in range(2):      # the second time from the cache: the same error
        with pytest.raises(InvalidRequestError) as err:
            run(compiler.compile(fmt))
        assert err.value.field == want
        assert str(err.value).startswith(want + ": ") and message in str(err.value)


def test_a_compile_past_the_timeout_is_refused_and_does_not_pile_up(
        compiler: GrammarCompiler, vocab: int, run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    c = GrammarCompiler(compiler.engine_tokenizer, vocab, compile_timeout=0.1, max_workers=1)
    release = threading.Event()
    build = c._build

    def slow(key: Any, field: str) -> CompiledGrammar:
        if key == ("regex", "slow", False):
            release.wait(10)
        return build(key, field)

    monkeypatch.setattr(c, "_build", slow)
    slow_fmt, other = pb.ResponseFormat(regex="slow"), pb.ResponseFormat(regex="other")
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"params.response_format.regex: too expensive to compile "
                                                  r"within 0.1 s"):
        run(c.compile(slow_fmt))
    assert time.monotonic() - t0 < 2          # the loop was not blocked by the compile
    assert c.cache_info() == {"cached": 0, "running": 1, "overdue": 1}
    with pytest.raises(InvalidRequestError, match="too expensive"):     # the same again: at once
        run(c.compile(slow_fmt))
    with pytest.raises(GrammarCompilerBusyError, match="busy") as busy:  # its thread is taken
        run(c.compile(other))
    assert isinstance(busy.value, QueueFullError)                        # RESOURCE_EXHAUSTED

    async def finish() -> None:
        release.set()
        while c.cache_info()["running"]:
            await asyncio.sleep(0.01)

    run(finish())
    assert isinstance(run(c.compile(other)), CompiledGrammar)
    assert isinstance(run(c.compile(slow_fmt)), CompiledGrammar)        # its late result was kept
    c.close()


def test_a_real_compile_with_a_tiny_timeout(compiler: GrammarCompiler, vocab: int, run: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    c = GrammarCompiler(compiler.engine_tokenizer, vocab, compile_timeout=1e-6)
    # The real compile, held until the timeout has been answered: a loop
    # starved for longer than the compile (a busy machine) would otherwise see
    # it finish first.
    gate, real = threading.Event(), c._build
    monkeypatch.setattr(c, "_build", lambda key, field: gate.wait(30) and real(key, field))
    with pytest.raises(InvalidRequestError, match="too expensive to compile within 1e-06 s"):
        run(c.compile(schema(NESTED)))
    gate.set()

    async def finish() -> None:
        while c.cache_info()["running"]:
            await asyncio.sleep(0.01)

    run(finish())
    assert isinstance(run(c.compile(schema(NESTED))), CompiledGrammar)   # its late result was kept
    c.close()


def test_constructor_checks(tokenizer: Any, compiler: GrammarCompiler, vocab: int) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tokenizer, len(tokenizer) - 1)
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(compiler.engine_tokenizer, vocab + 1)
    assert compiler.eos_token_ids == {EOS}        # the tokenizer's eos_token_id by default


# -- masks -----------------------------------------------------------------------------------

# json.dumps's default separators (", ", ": ") are the compact form; lenient JSON takes any layout.
@pytest.mark.parametrize("style, lenient", [
    (dict(ensure_ascii=False), False), (dict(), False),
    (dict(separators=(",", ":"), ensure_ascii=False), True), (dict(ensure_ascii=False), True),
    (dict(indent=2), True), (dict(indent=4), True)])
def test_every_token_of_a_valid_document_is_allowed_and_eos_only_at_the_end(
        compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any, style: dict[str, Any],
        lenient: bool) -> None:
    g = run(compiler.compile(schema(NESTED, lenient=lenient)))
    for doc in NESTED_DOCS:
        ids = encode(tokenizer, json.dumps(doc, **style))
        m = g.new_matcher()
        for t in ids:
            ok = allowed(m, vocab)
            assert t in ok, (tokenizer.decode(ids[:ids.index(t)]), tokenizer.decode([t]))
            assert EOS not in ok and not m.is_completed()
            assert m.accept_token(t)
        assert allowed(m, vocab).tolist() == [EOS]       # the object is closed: only EOS
        assert m.is_stopped() and m.accept_token(EOS) and m.is_terminated()


WS = rf"[ \t\n\r]{{0,{MAX_JSON_WHITESPACE}}}"
INT_MEMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _viable_prefix(pattern: str) -> Callable[[bytes], bool]:
    rx = re.compile(pattern.encode(), re.DOTALL)
    return lambda b: bool(b) and rx.fullmatch(b) is not None


@pytest.mark.parametrize("fmt, prefix, viable", [
    # At the start of a choice: exactly the tokens that begin one of the strings.
    (pb.ResponseFormat(choice=pb.Choice(choices=["yes", "no", "yesterday"])), "",
     lambda b: any(c.startswith(b) for c in (b"yes", b"no", b"yesterday")) and bool(b)),
    # The prefixes of (ab|cd)+x: (ab|cd)*(a|c)? or (ab|cd)+x.
    (pb.ResponseFormat(regex="(ab|cd)+x"), "", _viable_prefix(r"(?:ab|cd)*(?:a|c)?|(?:ab|cd)+x")),
    (pb.ResponseFormat(regex="(ab|cd)+x"), "abc", _viable_prefix(r"d(?:ab|cd)*(?:a|c)?|d(?:ab|cd)*x")),
    # An integer member's value, compact: exactly one space, an optional minus and digits,
    # then the closing brace at once.
    (schema(INT_MEMBER), '{"n":', _viable_prefix(r" (?:-|-?(?:0|[1-9][0-9]*)\}?)?")),
    # Lenient: whitespace (bounded) around the value. (No whitespace before a top-level value.)
    (schema(INT_MEMBER, lenient=True), '{"n":', _viable_prefix(rf"{WS}(?:-|-?(?:0|[1-9][0-9]*)(?:{WS}\}}?)?)?")),
    # Compact: after a member's value, ", " and the next key or the closing brace, nothing else.
    (schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a"]}), '{"a": 1', _viable_prefix(r"[0-9]*(?:\}|,(?: (?:\"b?(?:\":? ?)?)?)?)?")),
], ids=["choice-start", "regex-start", "regex-middle", "integer-member", "integer-member-lenient",
        "after-a-member"])
def test_mask_is_exactly_the_tokens_that_continue_a_valid_output(
        compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any, token_bytes: list[bytes],
        special: set[int], fmt: pb.ResponseFormat, prefix: str, viable: Callable[[bytes], bool]) -> None:
    m = run(compiler.compile(fmt)).new_matcher()
    for t in encode(tokenizer, prefix):
        assert m.accept_token(t)
    want = {i for i, b in enumerate(token_bytes) if i not in special and viable(b)}
    assert want and set(allowed(m, vocab).tolist()) == want


def test_bitmask_bit_order_and_fill_batch(compiler: GrammarCompiler, tokenizer: Any, vocab: int,
                                          run: Any) -> None:
    (hello,) = encode(tokenizer, "Hello")          # one token, not a multiple of 32
    assert hello % 32 != 0
    m = run(compiler.compile(pb.ResponseFormat(choice=pb.Choice(choices=["Hello"])))).new_matcher()
    out = allocate_bitmask(1, vocab)[0]
    assert out.shape == (bitmask_words(vocab),) == (-(-vocab // 32),)
    m.fill_bitmask(out)
    expect = np.zeros_like(out)
    expect[hello // 32] = np.int32(np.uint32(1 << (hello % 32)).view(np.int32))
    assert np.array_equal(out, expect)
    # As bytes on the wire (StepMasks.bitmask): bit t is bit t % 8 of byte t // 8.
    wire = out.tobytes()
    assert wire[hello // 8] == 1 << (hello % 8) and sum(wire) == wire[hello // 8]

    # fill_batch fills rows 0..n-1 like fill_bitmask, and leaves the other rows alone.
    g = run(compiler.compile(schema(NESTED)))
    ms = [g.new_matcher() for _ in range(3)]
    for t in encode(tokenizer, '{"id": "AB'):
        assert ms[1].accept_token(t)
    ms[2] = m
    batch = allocate_bitmask(5, vocab)
    batch[3:] = 0x5A5A5A5A
    fill_batch(ms, batch)
    for i, mi in enumerate(ms):
        row = allocate_bitmask(1, vocab)[0]
        mi.fill_bitmask(row)
        assert np.array_equal(batch[i], row)
    assert (batch[3:] == 0x5A5A5A5A).all()
    with pytest.raises(ValueError, match="shape"):
        fill_batch(ms, allocate_bitmask(2, vocab))
    with pytest.raises(ValueError, match="int32"):
        m.fill_bitmask(np.zeros(bitmask_words(vocab), dtype=np.int64))


def test_padding_ids_and_special_tokens_are_never_allowed(
        compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any, special: set[int]) -> None:
    g = run(compiler.compile(schema({"type": "object", "properties": {"s": {"type": "string"}}})))
    m = g.new_matcher()
    never = np.array(sorted((special - {EOS}) | set(range(len(tokenizer), vocab))))
    states = 0
    for t in [*encode(tokenizer, '{"s": "free text'), *encode(tokenizer, '"}')]:
        out = allocate_bitmask(1, vocab)[0]
        m.fill_bitmask(out)
        bits = np.unpackbits(out.view(np.uint8), bitorder="little")
        assert not bits[never].any() and not bits[vocab:].any()     # nor bits past the vocabulary
        states += int(bits.sum() > 40_000)                           # inside the string: nearly all
        assert m.accept_token(t)
    assert states >= 2
    # A padding id is not a token of the grammar: refused, and then only EOS is allowed.
    m = g.new_matcher()
    assert not m.accept_token(len(tokenizer) + 1)
    assert m.error() and allowed(m, vocab).tolist() == [EOS]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.accept_token(vocab)


def test_eos_ids_come_from_the_caller(compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any) -> None:
    c = GrammarCompiler(tokenizer, vocab, eos_token_ids=[EOS, 0])
    m = run(c.compile(pb.ResponseFormat(regex="ok"))).new_matcher()
    for t in encode(tokenizer, "ok"):
        assert m.accept_token(t)
    assert allowed(m, vocab).tolist() == [0, EOS]
    assert m.accept_token(0) and m.is_terminated()
    c.close()


def test_a_token_outside_the_mask_breaks_the_matcher(compiler: GrammarCompiler, tokenizer: Any, vocab: int,
                                                     run: Any) -> None:
    m = run(compiler.compile(pb.ResponseFormat(regex="[0-9]+"))).new_matcher()
    (a,) = encode(tokenizer, "a")
    assert a not in allowed(m, vocab)
    assert not m.accept_token(a)
    assert m.error() and allowed(m, vocab).tolist() == [EOS]   # the sequence can only end


def test_rollback(compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any) -> None:
    m = run(compiler.compile(pb.ResponseFormat(regex="(ab)+"))).new_matcher()
    start = allowed(m, vocab)
    ids = encode(tokenizer, "abab")
    for t in ids:
        assert m.accept_token(t)
    assert m.accept_token(EOS) and m.is_terminated()
    m.rollback(len(ids) + 1)
    assert not m.is_terminated() and np.array_equal(allowed(m, vocab), start)


# -- compact, closed JSON by default; lenient on request ------------------------------------

def free_whitespace(text: str) -> list[tuple[int, str]]:
    """Whitespace runs outside JSON strings other than the single space after ',' or ':'
    (offset, run): none in compact JSON. ``text`` may be a prefix of a document."""
    state = _WsScan()
    return state.feed(text)


class _WsScan:
    """free_whitespace, fed piece by piece (a prefix once, then each candidate token)."""

    __slots__ = ("in_string", "escaped", "prev", "run", "offset")

    def __init__(self) -> None:
        self.in_string = self.escaped = False
        self.prev, self.run, self.offset = "", "", 0

    def copy(self) -> _WsScan:
        other = _WsScan()
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


def test_free_whitespace_finds_what_compact_json_lacks() -> None:
    assert free_whitespace('{"a": 1, "b": [1, 2], "s": " x ,  y\\" "}') == []
    assert free_whitespace('{"a": 1,') == []
    assert [r for _, r in free_whitespace('{ "a":  1,\n"b":[1 ]}\n')] == [" ", "  ", "\n", " ", "\n"]


def produces(g: CompiledGrammar, text: str, by_bytes: dict[bytes, list[int]], vocab: int) -> bool:
    """Whether the masks let some tokenization of ``text`` through, from the start to a
    complete output (where EOS is allowed). The grammar is byte-level: after the same
    bytes the matcher is in the same state whatever the tokens, so each offset is
    expanded once."""
    data = text.encode()
    longest = max(len(b) for b in by_bytes)
    paths: dict[int, list[int]] = {0: []}
    todo = [0]
    while todo:
        pos = todo.pop()
        m = g.new_matcher()
        for t in paths[pos]:
            assert m.accept_token(t)
        ok = set(allowed(m, vocab).tolist())
        if pos == len(data):
            if EOS in ok:
                return True
            continue
        for end in range(pos + 1, min(len(data), pos + longest) + 1):
            for t in by_bytes.get(data[pos:end], ()):
                if t in ok and end not in paths:
                    paths[end] = [*paths[pos], t]
                    todo.append(end)
    return False


@pytest.fixture(scope="module")
def by_bytes(token_bytes: list[bytes], special: set[int]) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes):
        if b and i not in special:
            out.setdefault(b, []).append(i)
    return out


ABC = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}},
                                        "c": {"type": "object", "properties": {"d": {"type": "string"}}}}}
COMPACT_DOC = '{"a": 1, "b": [1, 2], "c": {"d": "x y"}}'
LOOSE_DOCS = ['{"a":1, "b": [1, 2], "c": {"d": "x y"}}', '{"a": 1,"b": [1, 2], "c": {"d": "x y"}}',
              '{ "a": 1, "b": [1, 2], "c": {"d": "x y"}}', '{"a": 1,  "b": [1, 2], "c": {"d": "x y"}}',
              '{"a": 1,\n"b": [1, 2], "c": {"d": "x y"}}', '{"a": 1, "b": [1 , 2], "c": {"d": "x y"}}',
              '{"a": 1, "b": [1, 2], "c": {"d": "x y"} }', '{\n  "a": 1,\n  "b": [1, 2],\n  "c": {"d": "x y"}\n}']


@pytest.mark.parametrize("fmt", [schema(ABC), pb.ResponseFormat(json_object=True)], ids=["schema", "json_object"])
def test_json_is_compact_by_default(compiler: GrammarCompiler, vocab: int, run: Any, by_bytes: dict[bytes, list[int]],
                                    fmt: pb.ResponseFormat) -> None:
    g = run(compiler.compile(fmt))
    assert produces(g, COMPACT_DOC, by_bytes, vocab)
    for loose in LOOSE_DOCS:
        assert not produces(g, loose, by_bytes, vocab), loose
    lenient = pb.ResponseFormat()
    lenient.CopyFrom(fmt)
    lenient.lenient_json = True
    g = run(compiler.compile(lenient))
    for doc in (COMPACT_DOC, *LOOSE_DOCS):
        assert produces(g, doc, by_bytes, vocab), doc


def test_no_token_of_the_mask_adds_free_whitespace(compiler: GrammarCompiler, tokenizer: Any, vocab: int,
                                                   run: Any, token_bytes: list[bytes]) -> None:
    """At every step of a document, every token the mask allows keeps the text compact
    (strings aside: inside one, any text)."""
    texts = [b.decode("utf-8", errors="replace") for b in token_bytes]
    spaced = {i for i, t in enumerate(texts) if any(c in t for c in " \t\n\r")}
    g = run(compiler.compile(schema(NESTED)))
    m, scan, checked = g.new_matcher(), _WsScan(), 0
    for t in encode(tokenizer, json.dumps(NESTED_DOCS[0], ensure_ascii=False)):
        for u in spaced.intersection(allowed(m, vocab).tolist()):
            assert scan.copy().feed(texts[u]) == [], (scan.offset, texts[u])
            checked += 1
        assert m.accept_token(t)
        scan.feed(texts[t])
    assert checked > 10_000       # inside strings nearly every spaced token is allowed


OPEN_A = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("s, closed_doc, extra_doc", [
    (OPEN_A, '{"a": 1}', '{"a": 1, "z": 2}'),
    # nested: an object property, array items, anyOf / oneOf members, $defs and definitions
    ({"type": "object", "properties": {"o": OPEN_A}}, '{"o": {"a": 1}}', '{"o": {"a": 1, "z": 2}}'),
    ({"type": "array", "items": OPEN_A}, '[{"a": 1}]', '[{"a": 1}, {"z": 2}]'),
    ({"anyOf": [OPEN_A, {"type": "integer"}]}, '{"a": 1}', '{"a": 1, "z": 2}'),
    ({"oneOf": [OPEN_A, {"type": "null"}]}, '{"a": 1}', '{"a": 1, "z": 2}'),
    ({"$defs": {"A": OPEN_A}, "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"]},
     '{"x": {"a": 1}}', '{"x": {"a": 1, "z": 2}}'),
    ({"definitions": {"A": OPEN_A}, "type": "array", "items": {"$ref": "#/definitions/A"}},
     '[{"a": 1}]', '[{"a": 1, "z": 2}]'),
    # no "type", but properties: an object schema too
    ({"properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": 1, "z": 2}'),
], ids=["top", "property", "items", "anyOf", "oneOf", "$defs", "definitions", "untyped"])
def test_objects_are_closed_by_default_and_open_when_lenient(
        compiler: GrammarCompiler, vocab: int, run: Any, by_bytes: dict[bytes, list[int]],
        s: dict[str, Any], closed_doc: str, extra_doc: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(extra_doc), s)          # the schema itself allows the extra key
    strict = run(compiler.compile(schema(s)))
    assert produces(strict, closed_doc, by_bytes, vocab)
    assert not produces(strict, extra_doc, by_bytes, vocab)
    lenient = run(compiler.compile(schema(s, lenient=True)))
    assert produces(lenient, closed_doc, by_bytes, vocab)
    assert produces(lenient, extra_doc, by_bytes, vocab)


@pytest.mark.parametrize("extra, doc, ok", [
    (True, '{"a": 1, "z": "anything"}', True),
    ({"type": "integer"}, '{"a": 1, "z": 2}', True),
    ({"type": "integer"}, '{"a": 1, "z": "no"}', False),
    # the map's values are objects: closed in their turn
    ({"type": "object", "properties": {"k": {"type": "integer"}}}, '{"z": {"k": 1}}', True),
    ({"type": "object", "properties": {"k": {"type": "integer"}}}, '{"z": {"k": 1, "q": 2}}', False),
], ids=["true", "schema", "schema-refused", "object-values", "object-values-closed"])
def test_an_explicit_additional_properties_is_kept(
        compiler: GrammarCompiler, vocab: int, run: Any, by_bytes: dict[bytes, list[int]],
        extra: Any, doc: str, ok: bool) -> None:
    g = run(compiler.compile(schema({**OPEN_A, "additionalProperties": extra})))
    assert produces(g, doc, by_bytes, vocab) is ok


def test_json_object_stays_any_object(compiler: GrammarCompiler, vocab: int, run: Any,
                                      by_bytes: dict[bytes, list[int]]) -> None:
    g = run(compiler.compile(pb.ResponseFormat(json_object=True)))
    assert produces(g, '{"anything": [1, {"x": null}], "b": {"c": "d"}}', by_bytes, vocab)
    assert not produces(g, '[1, 2]', by_bytes, vocab)


def test_close_objects_leaves_intersections_and_negations_open() -> None:
    a, b = {"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": OPEN_A}}
    s = {"allOf": [a, b, {"$ref": "#/$defs/C"}], "$defs": {"C": {"properties": {"c": {}}}, "D": OPEN_A},
         "not": OPEN_A}
    before = json.dumps(s)
    out = close_objects(s)
    assert json.dumps(s) == before                          # the input is not changed
    # allOf members (and the $defs one refers to) are parts of one object: left open, or
    # each would refuse the others' keys; what lies inside them is closed.
    assert [("additionalProperties" in m) for m in out["allOf"]] == [False, False, False]
    assert out["allOf"][1]["properties"]["b"]["additionalProperties"] is False
    assert "additionalProperties" not in out["$defs"]["C"] and "additionalProperties" not in out
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in out["not"]         # closing there would widen the schema
    # Object keywords beside anyOf: an intersection as well.
    mixed = close_objects({"type": "object", "properties": {"k": {}}, "anyOf": [OPEN_A, {"required": ["k"]}]})
    assert "additionalProperties" not in mixed and "additionalProperties" not in mixed["anyOf"][0]
    assert close_objects({"type": ["object", "null"]})["additionalProperties"] is False
    assert "additionalProperties" not in close_objects({"type": "string", "properties": {}})
    assert close_objects({"type": "object", "unevaluatedProperties": False}) == \
        {"type": "object", "unevaluatedProperties": False}


def test_allof_objects_keep_each_members_keys(compiler: GrammarCompiler, vocab: int, run: Any,
                                              by_bytes: dict[bytes, list[int]]) -> None:
    s = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                   {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    g = run(compiler.compile(schema(s)))
    assert produces(g, '{"a": 1, "b": 2}', by_bytes, vocab)


def test_the_cache_keeps_compact_and_lenient_apart(compiler: GrammarCompiler, vocab: int, run: Any,
                                                   by_bytes: dict[bytes, list[int]]) -> None:
    s = {"type": "object", "properties": {"cache_me": {"type": "integer"}}}
    lenient = run(compiler.compile(schema(s, lenient=True)))          # compiled first
    strict = run(compiler.compile(schema(s)))
    assert strict is not lenient and strict is run(compiler.compile(schema(s)))
    assert produces(lenient, '{"cache_me": 1, "z": 2}', by_bytes, vocab)
    assert not produces(strict, '{"cache_me": 1, "z": 2}', by_bytes, vocab)
    # Only JSON has a lenient form: json_object's two forms differ too.
    assert run(compiler.compile(pb.ResponseFormat(json_object=True))) is not \
        run(compiler.compile(pb.ResponseFormat(json_object=True, lenient_json=True)))


def test_constrained_requests_get_a_bounded_default_max_tokens(tokenizer: Any, vocab: int) -> None:
    def max_tokens(context: int, fmt: pb.ResponseFormat | None, **sampling: Any) -> int:
        p = pb.GenerationParams(text="Hi", sampling=pb.SamplingParams(**sampling))
        if fmt is not None:
            p.response_format.CopyFrom(fmt)
        v = validate_generation(p, tokenizer, ModelLimits(vocab_size=vocab, context_length=context),
                                new_seed=lambda: 1)
        return v.sampling.max_tokens

    prompt = len(encode(tokenizer, "Hi"))
    json_fmt = pb.ResponseFormat(json_object=True)
    assert CONSTRAINED_DEFAULT_MAX_TOKENS == 1024
    assert max_tokens(8192, json_fmt) == 1024
    assert max_tokens(8192, pb.ResponseFormat(regex="a+")) == 1024        # any format
    assert max_tokens(8192, None) == 8192 - prompt                          # free text: up to the context
    assert max_tokens(600, json_fmt) == 600 - prompt                        # capped by the context
    assert max_tokens(8192, json_fmt, max_tokens=5000) == 5000              # the request's own wins


# -- random walks over the masks -------------------------------------------------------------

WALK_SCHEMAS = {
    "nested": NESTED,
    "object": {"type": "object"},                    # closed unless lenient: "{}"
    "open-object": {"type": "object", "additionalProperties": True},
    "anyOf-array": {"type": "array", "minItems": 1, "maxItems": 5,
                    "items": {"anyOf": [{"enum": ["x", "y z", 7]}, {"type": "integer", "minimum": -3},
                                        {"type": "object", "properties": {"k": {"type": "boolean"}},
                                         "required": ["k"], "additionalProperties": False}]}},
}


@pytest.mark.parametrize("lenient", [False, True], ids=["compact", "lenient"])
@pytest.mark.parametrize("name", list(WALK_SCHEMAS))
def test_random_walks_over_the_mask_validate(compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any,
                                             token_bytes: list[bytes], name: str, lenient: bool) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    s = WALK_SCHEMAS[name]
    g = run(compiler.compile(schema(s, lenient=lenient)))
    # Tokens with punctuation in them are drawn half the time, so strings and numbers end.
    punct = np.zeros(vocab, dtype=bool)
    punct[:len(token_bytes)] = [any(not (chr(c).isalnum() or chr(c).isspace()) for c in b if c < 128)
                                for b in token_bytes]
    rng = np.random.default_rng(7)
    ended = 0
    for _ in range(5):
        m, ids = g.new_matcher(), []
        for _ in range(400):
            ok = allowed(m, vocab)
            if EOS in ok and rng.random() < 0.5:
                t = EOS
            else:
                p = ok[punct[ok]]
                t = int(rng.choice(p if p.size and rng.random() < 0.5 else ok))
            assert m.accept_token(t), m.error()
            if t == EOS:
                break
            ids.append(t)
        if m.is_terminated():
            ended += 1
            text = tokenizer.decode(ids)
            jsonschema.validate(json.loads(text), s)
            if not lenient:
                assert free_whitespace(text) == [], text
                if name == "object":
                    assert text == "{}"
    assert ended >= 3
