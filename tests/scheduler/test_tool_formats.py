"""Each family's tool-call format against that family's real chat template
(tests/support/data/chat_templates/, sources in its README), and the formats'
parsers on their own layouts: detection from the template's text, tools and tool
turns rendered by the template, the template's own rendering of a call parsed back
and accepted by the grammar, and Qwen3's <think> block split off."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from jitney.scheduler.api.http.openai.protocol import parse_request
from jitney.scheduler.api.servicer import GenerationServicer
from jitney.scheduler.api.tools.formats import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, detect_format, format_named
from jitney.scheduler.api.tools.grammar import tool_grammar
from jitney.scheduler.api.tools.spec import tool_request
from jitney.scheduler.api.tools.stream import OutputParser
from jitney.scheduler.api.validation import ModelLimits, render_prompt
from jitney.scheduler.core.grammar import GrammarCompiler
from tests.support.tool_turns import TOOLS, chat_template, weather_turns
from tests.support.scripted_worker import EOS, VOCAB, make_tokenizer

QWEN3 = chat_template("Qwen-Qwen3-0.6B.jinja")
TURNS = weather_turns()


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = QWEN3
    return tok


def render(tok: Any, body: dict[str, Any]) -> str:
    params = parse_request(body, chat=True).params
    ids = render_prompt(params, tok, ModelLimits(vocab_size=VOCAB, context_length=100_000), path="params",
                        tools=tool_request(params), tool_format=detect_format(tok.chat_template))
    return str(tok.decode(ids))


def test_detection_from_the_template_text() -> None:
    assert detect_format(QWEN3) is HERMES
    assert detect_format(make_tokenizer().chat_template) is GENERIC      # ChatML without tools
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is MISTRAL
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}") is LLAMA3
    assert format_named("llama3", QWEN3) is LLAMA3
    with pytest.raises(ValueError, match="tool-call-parser"):
        format_named("nope", None)


def test_qwen3_renders_tools_and_tool_turns(qwen_tokenizer: Any) -> None:
    text = render(qwen_tokenizer, {"messages": TURNS, "tools": TOOLS})
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    # arguments reach the template as a dict (transformers' convention): tojson writes them back
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>" in text


def test_qwen3s_own_call_rendering_parses_back_and_fits_the_grammar(qwen_tokenizer: Any) -> None:
    text = render(qwen_tokenizer, {"messages": TURNS, "tools": TOOLS})
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parser = OutputParser(HERMES)
    for ch in turn:                      # one character at a time: the parser's worst case
        parser.feed(ch)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"})]
    assert parser.content.strip() == ""
    params = parse_request({"messages": TURNS, "tools": TOOLS, "tool_choice": "required"}, chat=True).params
    req = tool_request(params)
    assert req is not None
    compiler = GrammarCompiler(qwen_tokenizer, VOCAB, eos_token_ids=[EOS])
    matcher = asyncio.run(compiler.compile_lark(tool_grammar(HERMES, req), "params.tools")).new_matcher()
    for t in qwen_tokenizer(turn, add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t), matcher.error()
    assert matcher.is_completed()


def test_qwen3_reasoning_mode_follows_enable_thinking(qwen_tokenizer: Any) -> None:
    servicer = GenerationServicer()
    state: Any = SimpleNamespace(tokenizer=qwen_tokenizer)
    for kwargs, mode in [({}, "maybe"), ({"enable_thinking": False}, "off")]:
        params = parse_request({"messages": TURNS[:1], "chat_template_kwargs": kwargs}, chat=True).params
        ids = render_prompt(params, qwen_tokenizer, ModelLimits(vocab_size=VOCAB, context_length=100_000),
                            path="params")
        assert servicer.reasoning_mode(state, params, ids) == mode
    plain: Any = SimpleNamespace(tokenizer=make_tokenizer())
    params = parse_request({"messages": TURNS[:1]}, chat=True).params
    assert servicer.reasoning_mode(plain, params, [1, 2]) == "off"
    assert GenerationServicer(reasoning="on").reasoning_mode(plain, params, [1, 2]) == "maybe"


def test_reasoning_is_split_from_content_and_calls() -> None:
    text = "<think>\nweather needs a call\n</think>\n\n" + HERMES.calls_text([("f", '{"a": [1, {"b": "}"}]}')])
    parser = OutputParser(HERMES, "maybe")
    reasoning = "".join(parser.feed(ch).reasoning for ch in text) + parser.finish().reasoning
    assert reasoning == parser.reasoning == "\nweather needs a call\n"
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", '{"a": [1, {"b": "}"}]}')]
    plain = OutputParser(None, "on")
    plain.feed("still thinking</think>the answer")
    plain.finish()
    assert (plain.reasoning, plain.content) == ("still thinking", "the answer")


# harmony (one call a turn, channels): tests/scheduler/test_tool_harmony.py
@pytest.mark.parametrize("name", sorted(set(FORMATS) - {"harmony"}))
def test_each_formats_layout_parses_back(name: str) -> None:
    fmt = FORMATS[name]
    calls = [("get_weather", '{"city": "Paris \\"17\\""}'), ("get_time", '{"zone": "UTC", "n": [1, 2]}')]
    text = ("" if not fmt.open else "One moment. ") + fmt.calls_text(calls)
    parser = OutputParser(fmt)
    pieces = [parser.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [parser.finish()]
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    for i, (_, args) in enumerate(calls):
        assert "".join(d.arguments for p in pieces for d in p.calls if d.index == i) == args
    assert parser.content == ("" if not fmt.open else "One moment. ")


def test_llama3_text_that_does_not_start_with_a_call_is_content() -> None:
    parser = OutputParser(LLAMA3)
    parser.feed('The call would be {"name": "f", "parameters": {}}')
    parser.finish()
    assert parser.calls == [] and parser.content.startswith("The call")


LLAMA32 = chat_template("meta-llama-Llama-3.2-3B-Instruct.jinja")


def test_llama32_template_is_llama3_and_its_call_parses_back() -> None:
    assert detect_format(LLAMA32) is LLAMA3
    tok = make_tokenizer()
    tok.chat_template = LLAMA32
    text = render(tok, {"messages": TURNS, "tools": TOOLS})
    assert '"name": "get_weather"' in text.split("weather in Paris?")[0]   # tools in the first user turn
    turn = text.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert turn == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    parser = OutputParser(LLAMA3)
    for ch in turn:
        parser.feed(ch)
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}')]
    params = parse_request({"messages": TURNS, "tools": TOOLS, "tool_choice": "required"}, chat=True).params
    req = tool_request(params)
    assert req is not None
    compiler = GrammarCompiler(tok, VOCAB, eos_token_ids=[EOS])
    matcher = asyncio.run(compiler.compile_lark(tool_grammar(LLAMA3, req), "params.tools")).new_matcher()
    for t in tok(turn, add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t), matcher.error()
    assert matcher.is_completed()


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.door_harness import text_worker_harness
    tok = make_tokenizer()
    tok.chat_template = QWEN3
    with text_worker_harness(tmp_path_factory.mktemp("ipc"), tok) as harness:
        yield harness


def test_qwen3_thinks_then_calls_through_the_door(qwen_server: Any) -> None:
    from tests.support.scripted_worker import MODEL
    call = HERMES.calls_text([("get_weather", '{"city": "Paris"}')])
    qwen_server.worker.target = "<think>\nneeds the weather tool\n</think>\n\n" + call
    qwen_server.worker.spelled.clear()
    reply = qwen_server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], tools=TOOLS,
                                                       tool_choice="required", max_tokens=200)
    message = reply.choices[0].message
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == "\nneeds the weather tool\n"
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls or []] == [
        ("get_weather", '{"city": "Paris"}')]
    assert reply.choices[0].finish_reason == "tool_calls"
    qwen_server.worker.target = "<think>short</think>\n" + call
    qwen_server.worker.spelled.clear()
    reasoning, args = "", ""
    for chunk in qwen_server.client.chat.completions.create(model=MODEL, messages=TURNS[:1], tools=TOOLS,
                                                            tool_choice="required", max_tokens=200, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
    assert (reasoning, args) == ("short", '{"city": "Paris"}')


def test_response_format_applies_after_the_reasoning(qwen_server: Any) -> None:
    import pydantic
    from tests.support.scripted_worker import MODEL

    class Answer(pydantic.BaseModel):
        answer: str
    qwen_server.worker.target = '<think>easy</think>\n\n{"answer": "yes"}'
    qwen_server.worker.spelled.clear()
    reply = qwen_server.client.chat.completions.parse(model=MODEL, messages=TURNS[:1], response_format=Answer,
                                                      max_tokens=100)
    assert reply.choices[0].message.parsed == Answer(answer="yes")
    assert (reply.choices[0].message.model_extra or {})["reasoning_content"] == "easy"
    # enable_thinking false: the template closes the block itself; nothing is parsed as reasoning
    qwen_server.worker.target = '{"answer": "no"}'
    qwen_server.worker.spelled.clear()
    reply = qwen_server.client.chat.completions.parse(
        model=MODEL, messages=TURNS[:1], response_format=Answer, max_tokens=100,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.parsed == Answer(answer="no")
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
