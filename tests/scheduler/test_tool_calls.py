"""Tool calling through the OpenAI door, with the openai SDK as client: the scheduler,
both doors and a worker that spells a chosen text under the grammar's masks
(tests/support/text_worker.py). The tiny tokenizer's ChatML template has no tool
support, so these run the generic format (tools in the system turn, Hermes-style
<tool_call> blocks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest

from tests.support.door_harness import Harness, text_worker_harness
from tests.support.scripted_worker import MODEL, PLAIN, make_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "weather in Paris?"}]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    tok = make_tokenizer()
    with text_worker_harness(tmp_path_factory.mktemp("ipc"), tok) as harness:
        yield harness


def spell(server: Harness, text: str) -> None:
    server.worker.target = text
    server.worker.spelled.clear()


def stream(server: Harness, **kw: Any) -> tuple[str, dict[int, dict[str, str]], str | None, list[Any]]:
    """(content, calls by index: id, name, arguments concatenated, finish_reason, raw deltas)."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in server.client.chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            deltas.append(d)
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not entry["id"], "a call's id comes once"
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish, deltas


def test_named_call_gives_the_tools_arguments(server: Harness) -> None:
    spell(server, call("get_weather", '{"city": "Paris"}'))
    reply = server.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [tc] = choice.message.tool_calls or []
    assert tc.type == "function" and tc.id.startswith("call_")
    assert tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}


def test_named_call_forces_the_named_tool(server: Harness) -> None:
    # The worker tries to call get_weather; the grammar allows only get_time.
    spell(server, call("get_weather", '{"city": "Paris"}'))
    reply = server.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [tc] = reply.choices[0].message.tool_calls or []
    assert tc.function.name == "get_time"
    assert set(json.loads(tc.function.arguments)) == {"zone"}


def test_required_streamed_fragments_are_the_arguments(server: Harness) -> None:
    spell(server, call("get_weather", '{"city": "Paris", "unit": "c"}'))
    content, calls, finish, deltas = stream(server, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=200)
    assert finish == "tool_calls" and content == ""
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == '{"city": "Paris", "unit": "c"}'
    assert sum(1 for d in deltas for tc in d.tool_calls or []) > 3      # streamed in pieces


def test_auto_text_then_call(server: Harness) -> None:
    text = "Let me look. " + call("get_time", '{"zone": "CET"}')
    spell(server, text)
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look."
    [tc] = message.tool_calls or []
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_time", {"zone": "CET"})
    spell(server, text)
    content, calls, finish, _ = stream(server, messages=ASK, tools=TOOLS, max_tokens=200)
    assert content == "Let me look. " and finish == "tool_calls"
    assert calls[0]["arguments"] == '{"zone": "CET"}'


def test_auto_may_answer_in_text(server: Harness) -> None:
    spell(server, "It is sunny.")
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=50)
    assert reply.choices[0].message.content == "It is sunny."
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_auto_call_with_a_wrong_name_is_held_to_the_tools(server: Harness) -> None:
    # After the marker the grammar allows only the tools' names and schemas.
    spell(server, call("rm_rf", '{"path": "/"}'))
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    [tc] = reply.choices[0].message.tool_calls or []
    assert tc.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(tc.function.arguments), dict)


def test_none_parses_no_calls(server: Harness) -> None:
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                  tool_choice="none", max_tokens=50)
    assert reply.choices[0].message.content == PLAIN        # unconstrained: the plain script
    assert reply.choices[0].message.tool_calls is None


def test_parallel_calls_and_parallel_false(server: Harness) -> None:
    both = call("get_weather", '{"city": "Oslo"}') + "\n" + call("get_time", '{"zone": "UTC"}')
    spell(server, both)
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                  tool_choice="required", max_tokens=300)
    names = [tc.function.name for tc in reply.choices[0].message.tool_calls or []]
    assert names == ["get_weather", "get_time"]
    spell(server, both)
    content, calls, finish, _ = stream(server, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=300)
    assert [c["name"] for c in calls.values()] == names and list(calls) == [0, 1]
    assert [c["arguments"] for c in calls.values()] == ['{"city": "Oslo"}', '{"zone": "UTC"}']
    spell(server, both)
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300,
                                                  tool_choice="required", parallel_tool_calls=False)
    assert [tc.function.name for tc in reply.choices[0].message.tool_calls or []] == ["get_weather"]


def test_tool_result_turn_is_rendered(server: Harness) -> None:
    spell(server, "Sunny in Paris.")
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    reply = server.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=50)
    assert reply.choices[0].message.content == "Sunny in Paris."
    # What the template got: the generic format writes the call and the result as text.
    from jitney.scheduler.api.http.openai.protocol import parse_request
    from jitney.scheduler.api.validation import render_prompt
    from jitney.scheduler.api.tools.formats import GENERIC
    from jitney.scheduler.api.tools.spec import tool_request
    state = server.servicer.state
    assert state is not None
    params = parse_request({"messages": messages, "tools": TOOLS}, chat=True).params
    ids = render_prompt(params, state.tokenizer, state.limits, path="params", tools=tool_request(params),
                        tool_format=GENERIC)
    text = state.tokenizer.decode(ids)
    assert call("get_weather", '{"city": "Paris"}') in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    assert '"name": "get_time"' in text.split("<|im_start|>user")[0]      # tools in the system turn


class Answer(pydantic.BaseModel):
    answer: str


def test_parse_with_a_pydantic_model(server: Harness) -> None:
    spell(server, '{"answer": "yes"}')
    reply = server.client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Answer,
                                                 max_tokens=50)
    assert reply.choices[0].message.parsed == Answer(answer="yes")


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].arguments"),
])
def test_bad_tool_requests_name_the_parameter(server: Harness, body: dict[str, Any], param: str) -> None:
    args = {"messages": ASK, "max_tokens": 5, **body}
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(model=MODEL, **args)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert param in error["message"]


def test_no_blocks_leak(server: Harness) -> None:
    assert server.engine_load()[3] == 0


def grpc_params(**kw: Any) -> Any:
    from jitney.v1 import generation_pb2 as pb
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="weather in Paris?")])
    return pb.GenerationParams(chat=chat, sampling=pb.SamplingParams(max_tokens=200), **kw)


def test_grpc_calls_whole_and_streamed(server: Harness) -> None:
    from jitney.v1 import generation_pb2 as pb
    tools = [pb.Tool(name="get_weather", parameters=json.dumps(WEATHER["function"]["parameters"]))]
    spell(server, call("get_weather", '{"city": "Rome"}'))
    reply = server.stub.Generate(pb.GenerateRequest(params=grpc_params(tools=tools, tool_choice="required")),
                                 timeout=20)
    [tc] = reply.tool_calls
    assert (tc.name, tc.arguments) == ("get_weather", '{"city": "Rome"}') and tc.id.startswith("call_")
    assert reply.content == "" and reply.text.startswith("<tool_call>")
    spell(server, call("get_weather", '{"city": "Rome"}'))
    parts = list(server.stub.GenerateStream(
        pb.GenerateStreamRequest(params=grpc_params(tools=tools, tool_choice="required")), timeout=20))
    deltas = [d for p in parts for d in p.tool_call_deltas]
    assert deltas[0].name == "get_weather" and deltas[0].id and all(not d.id for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"city": "Rome"}'


def test_grpc_plain_answer_is_all_content(server: Harness) -> None:
    from jitney.v1 import generation_pb2 as pb
    reply = server.stub.Generate(pb.GenerateRequest(params=grpc_params()), timeout=20)
    assert reply.content == reply.text == PLAIN and not reply.tool_calls


@pytest.mark.parametrize(("kw", "field"), [
    ({"tools": [{"name": "f", "parameters": "[1"}]}, "params.tools[0].parameters"),
    ({"tools": [{"name": "f"}], "tool_choice": "function", "tool_choice_function": "g"},
     "params.tool_choice_function"),
    ({"tool_choice": "required"}, "params.tool_choice"),
])
def test_grpc_bad_tools_are_invalid_argument(server: Harness, kw: dict[str, Any], field: str) -> None:
    import grpc
    from jitney.v1 import generation_pb2 as pb
    tools = [pb.Tool(**t) for t in kw.pop("tools", [])]
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(pb.GenerateRequest(params=grpc_params(tools=tools, **kw)), timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
