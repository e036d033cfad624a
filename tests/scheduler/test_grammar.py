"""Structured output (jitney.scheduler.core.grammar) with the served tokenizer (SmolLM2's):
each format kind, the errors, the masks.

The model's logits width is taken wider than the tokenizer (VOCAB) so that the
padding ids are checked too. One event loop and one compiler serve the module
(conftest.py); compact and closed JSON are in test_grammar_json.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from jitney.scheduler.core.admission import QueueFullError
from jitney.scheduler.core.grammar import (
    MAX_JSON_WHITESPACE,
    CompiledGrammar,
    GrammarCompiler,
    GrammarCompilerBusyError,
    allocate_bitmask,
    bitmask_words,
    fill_batch,
)
from jitney.scheduler.core.request import InvalidRequestError
from jitney.v1 import generation_pb2 as pb
from tests.support.grammar_formats import EOS, NESTED, NESTED_DOCS, allowed, encode, schema


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
