"""Structured output's JSON (jitney.scheduler.core.grammar) with the served tokenizer
(SmolLM2's): compact and closed by default, lenient on request, the default
max_tokens of a constrained request, and random walks over the masks.

The fixtures (one event loop and one compiler per module) are in conftest.py;
the format kinds, errors and masks in test_grammar.py.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from jitney.scheduler.api.validation import CONSTRAINED_DEFAULT_MAX_TOKENS, ModelLimits, validate_generation
from jitney.scheduler.core.grammar import CompiledGrammar, GrammarCompiler, close_objects
from jitney.v1 import generation_pb2 as pb
from tests.support.grammar_formats import EOS, NESTED, NESTED_DOCS, allowed, encode, schema
from tests.support.json_whitespace import WhitespaceScan, free_whitespace


# -- compact, closed JSON by default; lenient on request ------------------------------------

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
    m, scan, checked = g.new_matcher(), WhitespaceScan(), 0
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
