"""gpt-oss's harmony format against gpt-oss's real chat template
(tests/support/data/chat_templates/openai-gpt-oss-120b.jinja, source in its README),
with a tiny tokenizer whose harmony markers are special tokens as in gpt-oss's:
detection, tools and tool turns rendered, the template's own call parsed back and
accepted by the grammar, channels split into reasoning / content / a call, streamed
== whole, the grammar's random walks schema-valid, and the whole path through the
door (the detokenizer keeps the markers for the parser)."""

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
from jitney.scheduler.api.tools.formats import (HARMONY, HARMONY_TOKENS, HERMES, detect_format, is_harmony,
                                                marker_tokens, one_call_per_turn)
from jitney.scheduler.api.tools.grammar import reasoned_grammar, tool_grammar
from jitney.scheduler.api.tools.spec import ToolRequest, ToolSpec, tool_request
from jitney.scheduler.api.tools.stream import OutputParser
from jitney.scheduler.api.validation import ModelLimits, render_prompt
from jitney.scheduler.core.detokenizer import IncrementalDetokenizer
from jitney.scheduler.core.grammar import GrammarCompiler, allocate_bitmask, engine_grammar
from jitney.v1 import generation_pb2 as pb
from tests.support.tool_turns import TOOLS, chat_template, weather_turns
from tests.support.scripted_worker import EOS, VOCAB, make_tokenizer
from tests.support.text_worker import walk_step
from tests.support.tool_schemas import SCHEMAS

GPT_OSS = chat_template("openai-gpt-oss-120b.jinja")
TURNS = weather_turns()
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
ANSWER = ("<|channel|>analysis<|message|>Easy: <b>22</b> C.<|end|><|start|>assistant"
          "<|channel|>final<|message|>It is 22 C in Paris.")


@pytest.fixture(scope="module")
def tok() -> Any:
    t = make_tokenizer(HARMONY_TOKENS)
    t.chat_template = GPT_OSS
    return t


@pytest.fixture(scope="module")
def compiler(tok: Any) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, eos_token_ids=[EOS])


def render(tok: Any, body: dict[str, Any]) -> str:
    params = parse_request(body, chat=True).params
    ids = render_prompt(params, tok, ModelLimits(vocab_size=VOCAB, context_length=100_000), path="params",
                        tools=tool_request(params), tool_format=detect_format(tok.chat_template))
    return str(tok.decode(ids))


def ids_of(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def accepts(compiler: GrammarCompiler, grammar: str, ids: list[int]) -> bool:
    compile_ = compiler.compile_toplevel if grammar.startswith("{") else compiler.compile_lark
    matcher = asyncio.run(compile_(grammar, "params.tools")).new_matcher()
    return all(matcher.accept_token(t) for t in ids) and matcher.is_completed()


def req(choice: str = "required", tools: Any = None) -> ToolRequest:
    r = tool_request(parse_request({"messages": TURNS[:1], "tools": tools or TOOLS, "tool_choice": choice},
                                   chat=True).params)
    assert r is not None
    return r


def test_detection_and_marker_tokens(tok: Any) -> None:
    assert detect_format(GPT_OSS) is HARMONY and is_harmony(GPT_OSS)
    tokens = marker_tokens(HARMONY, tok)
    assert set(tokens) == set(HARMONY_TOKENS)
    assert all(tok.convert_ids_to_tokens(i) == m for m, i in tokens.items())
    # the same markers as plain text (a tokenizer without them as special tokens): none
    assert marker_tokens(HARMONY, make_tokenizer()) == {}


def test_template_renders_tools_calls_and_results(tok: Any) -> None:
    text = render(tok, {"messages": TURNS, "tools": TOOLS})
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|>') in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C"<|end|>' in text
    assert text.endswith("<|start|>assistant")


def test_two_calls_in_one_message_become_two_turns(tok: Any) -> None:
    two = [TURNS[0],
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "b", "content": "noon"},
           {"role": "tool", "tool_call_id": "a", "content": "3 C"}]
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "description": "Time",
                                                       "parameters": {"type": "object", "properties": {}}}}]
    text = render(tok, {"messages": two, "tools": tools})
    order = [text.find(s) for s in ("to=functions.get_weather<|channel|>", "functions.get_weather to=assistant",
                                    "to=functions.get_time<|channel|>", "functions.get_time to=assistant")]
    assert -1 not in order and order == sorted(order)
    assert '"3 C"' in text.split("functions.get_weather to=assistant")[1].split("<|end|>")[0]
    assert '"noon"' in text.split("functions.get_time to=assistant")[1].split("<|end|>")[0]
    # an id answered twice: nothing is reordered
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"id": "a"}, {"id": "b"}]},
            {"role": "tool", "tool_call_id": "a"}, {"role": "tool", "tool_call_id": "a"}]
    assert [m["role"] for m in one_call_per_turn(msgs)] == ["assistant", "assistant", "tool", "tool"]


def test_the_templates_own_call_parses_back_and_fits_the_grammar(tok: Any, compiler: GrammarCompiler) -> None:
    text = render(tok, {"messages": TURNS, "tools": TOOLS})
    turn = text.split("<|start|>assistant", 1)[1].split("<|call|>")[0]
    assert turn.startswith(" to=functions.get_weather<|channel|>")
    parser = OutputParser(HARMONY, "harmony")
    for ch in turn:
        parser.feed(ch)
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}')]
    assert parser.content == parser.reasoning == ""
    tokens = marker_tokens(HARMONY, tok)
    assert accepts(compiler, tool_grammar(HARMONY, req(), "harmony", tokens), ids_of(tok, turn))


def test_channels_split_streamed_equals_whole() -> None:
    for text, reasoning, content, calls in [
            (CALL, "Need the weather tool.", "", [("get_weather", '{"city": "Paris"}')]),
            (ANSWER, "Easy: <b>22</b> C.", "It is 22 C in Paris.", []),
            ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL[len("<|channel|>analysis"
             "<|message|>Need the weather tool.<|end|><|start|>assistant"):], "", "Checking.",
             [("get_weather", '{"city": "Paris"}')])]:
        for size in (1, 3, 7, len(text)):
            parser = OutputParser(HARMONY, "harmony")
            pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
            assert "".join(p.reasoning for p in pieces) == parser.reasoning == reasoning
            assert "".join(p.content for p in pieces) == parser.content == content
            assert [(c.name, c.arguments) for c in parser.calls] == calls
            for i, (_, args) in enumerate(calls):
                assert "".join(d.arguments for p in pieces for d in p.calls if d.index == i) == args
                assert sum(1 for p in pieces for d in p.calls if d.index == i and d.name) == 1


def test_no_tools_a_call_is_not_parsed_and_a_header_less_output_is_content() -> None:
    parser = OutputParser(None, "harmony")
    parser.feed(CALL)
    parser.finish()
    assert parser.calls == [] and parser.content == '{"city": "Paris"}'
    plain = OutputParser(None, "harmony")
    plain.feed("x" * 300)
    plain.feed(" and more")
    plain.finish()
    assert plain.content == "x" * 300 + " and more"
    with pytest.raises(ValueError, match="harmony"):
        OutputParser(HERMES, "harmony")


def test_grammar_forced_auto_and_the_answers_format(tok: Any, compiler: GrammarCompiler) -> None:
    tokens = marker_tokens(HARMONY, tok)
    forced = tool_grammar(HARMONY, req("required"), "harmony", tokens)
    auto = tool_grammar(HARMONY, req("auto"), "harmony", tokens)
    assert accepts(compiler, forced, ids_of(tok, CALL) + [EOS])
    assert not accepts(compiler, forced, ids_of(tok, ANSWER))                 # required: a call
    assert accepts(compiler, auto, ids_of(tok, ANSWER) + [EOS])
    assert accepts(compiler, auto, ids_of(tok, CALL) + [EOS])
    bad = CALL.replace('{"city": "Paris"}', '{"town": "Paris"}')
    assert not accepts(compiler, auto, ids_of(tok, bad))                      # lazily held to the schema
    assert not accepts(compiler, auto, ids_of(tok, CALL.replace("get_weather", "get_wether")))
    # the markers spelled out in text tokens are not the markers
    spelled = [t for m in ("<|channel|>",) for t in tok(m, add_special_tokens=False, split_special_tokens=True)
               ["input_ids"]]
    assert len(spelled) > 1 and not accepts(compiler, auto, spelled)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = reasoned_grammar(engine_grammar(pb.ResponseFormat(json_schema=json.dumps(schema)))[0], "harmony", tokens)
    good = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
    assert accepts(compiler, fmt, ids_of(tok, good + '{"answer": "yes"}') + [EOS])
    assert not accepts(compiler, fmt, ids_of(tok, good + "yes"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1),
       choice=st.sampled_from(["auto", "required"]))
def test_random_walks_give_schema_valid_calls(tok: Any, compiler: GrammarCompiler,
                                              schemas: list[dict[str, Any]], seed: int, choice: str) -> None:
    tools = tuple(ToolSpec(f"tool_{i}", "", s) for i, s in enumerate(schemas))
    grammar = tool_grammar(HARMONY, ToolRequest(tools, choice, "", True), "harmony", marker_tokens(HARMONY, tok))
    matcher = asyncio.run(compiler.compile_lark(grammar, "params.tools")).new_matcher()
    texts = [tok.decode([t]) for t in range(VOCAB)]
    rng = random.Random(seed)
    # most walks head for a call; the rest wander
    lead = "<|channel|>commentary to=functions.tool_0" if rng.random() < 0.7 else ""
    parser = OutputParser(HARMONY, "harmony")
    streamed: dict[int, str] = {}
    output, ids = "", []
    mask = allocate_bitmask(1, VOCAB)[0]
    for _ in range(400):
        token = walk_step(matcher, mask, texts, lead, output, rng)
        if token == EOS:
            break
        ids.append(token)
        text = tok.decode(ids)
        if text.endswith("\ufffd"):
            continue
        new, output = text[len(output):], text
        for d in parser.feed(new).calls:
            streamed[d.index] = streamed.get(d.index, "") + d.arguments
    else:
        return
    parser.finish()
    if choice == "required":
        assert len(parser.calls) == 1
    assert len(parser.calls) <= 1
    whole = OutputParser(HARMONY, "harmony")
    whole.feed(output)
    whole.finish()
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in parser.calls]
    assert (whole.content, whole.reasoning) == (parser.content, parser.reasoning)
    by_name = {t.name: t.parameters for t in tools}
    for i, c in enumerate(parser.calls):
        jsonschema.validate(json.loads(c.arguments), by_name[c.name])
        assert streamed[i] == c.arguments


def test_detokenizer_keeps_only_the_markers_asked_for(tok: Any) -> None:
    ids = ids_of(tok, ANSWER)
    tokens = marker_tokens(HARMONY, tok)

    def run(keep: frozenset[int]) -> str:
        d = IncrementalDetokenizer(tok, ids_of(tok, "<|start|>assistant"), keep_special=keep)
        return "".join(d.push([t]).text for t in ids) + d.flush()
    assert run(frozenset(tokens.values())) == ANSWER
    assert run(frozenset()) == tok.decode(ids, skip_special_tokens=True)
    assert "<|channel|>" not in run(frozenset())
    only = run(frozenset({tokens["<|message|>"]}))
    assert "<|message|>" in only and "<|channel|>" not in only


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Any:
    from tests.support.door_harness import text_worker_harness
    with text_worker_harness(tmp_path_factory.mktemp("ipc"), tok) as harness:
        yield harness


def test_gpt_oss_through_the_door(server: Any) -> None:
    from tests.support.scripted_worker import MODEL
    server.worker.target = CALL
    server.worker.spelled.clear()
    reply = server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], tools=TOOLS,
                                                  tool_choice="required", max_tokens=200)
    message = reply.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "Need the weather tool."
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls or []] == [
        ("get_weather", '{"city": "Paris"}')]
    assert reply.choices[0].finish_reason == "tool_calls"
    server.worker.spelled.clear()
    reasoning, args, names = "", "", []
    for chunk in server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], tools=TOOLS,
                                                       tool_choice="auto", max_tokens=200, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
            names += [t.function.name for t in c.delta.tool_calls or [] if t.function.name]
    assert (reasoning, args, names) == ("Need the weather tool.", '{"city": "Paris"}', ["get_weather"])
    # no tools: the channels still split, the final one is the content
    server.worker.plain = ids_of(server.tokenizer, ANSWER) + [EOS]      # unconstrained: its script
    plain = server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], max_tokens=200).choices[0]
    assert plain.message.content == "It is 22 C in Paris."
    assert (plain.message.model_extra or {})["reasoning_content"] == "Easy: <b>22</b> C."
    server.worker.spelled.clear()
    import pydantic

    class Answer(pydantic.BaseModel):
        answer: str
    server.worker.target = ANSWER.replace("It is 22 C in Paris.", '{"answer": "22 C"}')
    reply2 = server.client.chat.completions.parse(model=MODEL, messages=TURNS[:1], response_format=Answer,
                                                  max_tokens=200)
    assert reply2.choices[0].message.parsed == Answer(answer="22 C")
    assert (reply2.choices[0].message.model_extra or {})["reasoning_content"] == "Easy: <b>22</b> C."
