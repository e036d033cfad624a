"""Mistral's ``[TOOL_CALLS]`` as one special token (as in Mistral's own tokenizers)
and as plain text, against Mistral Nemo's real chat template
(tests/support/data/chat_templates/, source in its README): the grammar asks for the
token (llguidance never lets a special token stand for text), free text may not
spell the marker, the detokenizer keeps the token's text for the parser, and the
whole path through the door."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitney.scheduler.api.http.openai.protocol import parse_request
from jitney.scheduler.api.tools.formats import MISTRAL, detect_format, marker_tokens
from jitney.scheduler.api.tools.grammar import tool_grammar
from jitney.scheduler.api.tools.spec import ToolRequest, ToolSpec, tool_request
from jitney.scheduler.api.tools.stream import OutputParser
from jitney.scheduler.api.validation import ModelLimits, render_prompt
from jitney.scheduler.core.detokenizer import IncrementalDetokenizer
from jitney.scheduler.core.grammar import GrammarCompiler, allocate_bitmask
from tests.support.tool_turns import TOOLS, chat_template, weather_turns
from tests.support.scripted_worker import EOS, VOCAB, make_tokenizer
from tests.support.text_worker import walk_step
from tests.support.tool_schemas import SCHEMAS

NEMO = chat_template("mistralai-Mistral-Nemo-Instruct-2407.jinja")
# Mistral's control tokens, special in its tokenizer
CONTROL = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
           "[TOOL_CALLS]")
TURNS = weather_turns("call00001")
CALLS = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def nemo(special: bool) -> Any:
    tok = make_tokenizer(CONTROL if special else ())
    tok.chat_template = NEMO
    return tok


@pytest.fixture(scope="module")
def tok() -> Any:
    return nemo(True)


@pytest.fixture(scope="module")
def text_tok() -> Any:
    return nemo(False)


def ids_of(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def accepts(tok: Any, grammar: str, ids: list[int]) -> bool:
    compiler = GrammarCompiler(tok, VOCAB, eos_token_ids=[EOS])
    matcher = asyncio.run(compiler.compile_lark(grammar, "params.tools")).new_matcher()
    return all(matcher.accept_token(t) for t in ids) and matcher.is_completed()


def req(choice: str) -> ToolRequest:
    r = tool_request(parse_request({"messages": TURNS[:1], "tools": TOOLS, "tool_choice": choice},
                                   chat=True).params)
    assert r is not None
    return r


def test_detection_and_the_token(tok: Any, text_tok: Any) -> None:
    assert detect_format(NEMO) is MISTRAL
    tokens = marker_tokens(MISTRAL, tok)
    assert list(tokens) == ["[TOOL_CALLS]"] and tok.convert_ids_to_tokens(tokens["[TOOL_CALLS]"]) == "[TOOL_CALLS]"
    assert ids_of(tok, CALLS)[0] == tokens["[TOOL_CALLS]"]
    assert marker_tokens(MISTRAL, text_tok) == {}
    assert len(ids_of(text_tok, "[TOOL_CALLS]")) > 1


def test_the_templates_own_calls_parse_back(tok: Any) -> None:
    params = parse_request({"messages": TURNS, "tools": TOOLS}, chat=True).params
    ids = render_prompt(params, tok, ModelLimits(vocab_size=VOCAB, context_length=100_000), path="params",
                        tools=tool_request(params), tool_format=MISTRAL)
    text = str(tok.decode(ids))
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in text
    turn = text.split("[/INST]")[1].split("<|im_end|>")[0]
    assert turn == '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]'
    assert '[TOOL_RESULTS]{"content": 22 C, "call_id": "call00001"}[/TOOL_RESULTS]' in text
    parser = OutputParser(MISTRAL)
    for ch in turn:
        parser.feed(ch)
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}')]


def test_grammar_asks_for_the_token(tok: Any, text_tok: Any) -> None:
    tokens = marker_tokens(MISTRAL, tok)
    spelled = ids_of(text_tok, CALLS)          # the same text, the marker in ordinary tokens
    for choice in ("required", "auto"):
        grammar = tool_grammar(MISTRAL, req(choice), tokens=tokens)
        assert "<[" in grammar
        assert accepts(tok, grammar, ids_of(tok, CALLS) + [EOS])
        assert accepts(tok, grammar, ids_of(tok, "Let me check. " + CALLS) + [EOS]) == (choice == "auto")
        assert not accepts(tok, grammar, spelled)
        # after the token the schema holds
        assert not accepts(tok, grammar, ids_of(tok, CALLS.replace('"city"', '"town"')))
    auto = tool_grammar(MISTRAL, req("auto"), tokens=tokens)
    assert accepts(tok, auto, ids_of(tok, "no call needed") + [EOS])
    # free text may not spell the marker: in the text, "[TOOL_CALLS]" is always the token
    assert not accepts(tok, auto, ids_of(text_tok, "see [TOOL_CALLS] here"))
    # the text case is as before: the marker spelled out
    for choice in ("required", "auto"):
        assert accepts(text_tok, tool_grammar(MISTRAL, req(choice)), spelled + [EOS])


def test_the_detokenizer_keeps_the_token_for_the_parser(tok: Any) -> None:
    ids = ids_of(tok, "Let me check. " + CALLS)
    keep = frozenset(marker_tokens(MISTRAL, tok).values())

    def parse(keep_special: frozenset[int]) -> OutputParser:
        d = IncrementalDetokenizer(tok, ids_of(tok, "[INST]hi[/INST]"), keep_special=keep_special)
        parser = OutputParser(MISTRAL)
        for t in ids:
            parser.feed(d.push([t]).text)
        parser.feed(d.flush())
        parser.finish()
        return parser
    kept = parse(keep)
    assert [(c.name, c.arguments) for c in kept.calls] == [("get_weather", '{"city": "Paris"}')]
    assert kept.content == "Let me check. "
    dropped = parse(frozenset())       # what a text match on skip-special text would see: no marker
    assert dropped.calls == [] and dropped.content.startswith("Let me check. [{")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=2), seed=st.integers(0, 2**32 - 1),
       choice=st.sampled_from(["auto", "required"]))
def test_random_walks_with_the_token_give_schema_valid_calls(tok: Any, schemas: list[dict[str, Any]], seed: int,
                                                             choice: str) -> None:
    tools = tuple(ToolSpec(f"tool_{i}", "", s) for i, s in enumerate(schemas))
    tokens = marker_tokens(MISTRAL, tok)
    compiler = GrammarCompiler(tok, VOCAB, eos_token_ids=[EOS])
    grammar = tool_grammar(MISTRAL, ToolRequest(tools, choice, "", True), tokens=tokens)
    matcher = asyncio.run(compiler.compile_lark(grammar, "params.tools")).new_matcher()
    texts = [tok.decode([t]) for t in range(VOCAB)]
    rng = random.Random(seed)
    lead = "ok [TOOL_CALLS]" if choice == "auto" and rng.random() < 0.8 else ""
    detok = IncrementalDetokenizer(tok, [], keep_special=frozenset(tokens.values()))
    parser = OutputParser(MISTRAL)
    output = ""
    streamed: dict[int, str] = {}
    mask = allocate_bitmask(1, VOCAB)[0]
    for _ in range(400):
        token = walk_step(matcher, mask, texts, lead, output, rng)
        if token == EOS:
            break
        new = detok.push([token]).text
        output += new
        for d in parser.feed(new).calls:
            streamed[d.index] = streamed.get(d.index, "") + d.arguments
    else:
        return
    tail = detok.flush()
    output += tail
    parser.feed(tail)
    parser.finish()
    if choice == "required":
        assert parser.calls
    if lead and "[TOOL_CALLS]" in output:
        assert parser.calls
    by_name = {t.name: t.parameters for t in tools}
    for i, c in enumerate(parser.calls):
        jsonschema.validate(json.loads(c.arguments), by_name[c.name])
        assert streamed[i] == c.arguments


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Any:
    from tests.support.door_harness import text_worker_harness
    with text_worker_harness(tmp_path_factory.mktemp("ipc"), tok) as harness:
        yield harness


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_token_through_the_door(server: Any, choice: str) -> None:
    from tests.support.scripted_worker import MODEL
    server.worker.target = "Checking. " + CALLS if choice == "auto" else CALLS
    server.worker.spelled.clear()
    reply = server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], tools=TOOLS,
                                                  tool_choice=choice, max_tokens=200)
    message = reply.choices[0].message
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls or []] == [
        ("get_weather", '{"city": "Paris"}')]
    assert "[TOOL_CALLS]" not in (message.content or "")
    assert reply.choices[0].finish_reason == "tool_calls"
    server.worker.spelled.clear()
    args = ""
    for chunk in server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], tools=TOOLS,
                                                       tool_choice=choice, max_tokens=200, stream=True):
        for c in chunk.choices:
            args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
    assert args == '{"city": "Paris"}'
