"""Anthropic's Messages API (scheduler/api/http/anthropic/) through the official
``anthropic`` SDK: the scheduler and its doors in process over a worker that spells
PLAIN, or a chosen text under the grammar's masks (tests/support/text_worker.py).
The tiny tokenizer's ChatML template has no tool support: tools run the generic
format (Hermes-style <tool_call> blocks)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from jitney.scheduler.api.http.anthropic.events import MessageAssembler
from jitney.scheduler.api.http.anthropic.protocol import AnthropicError, parse_messages_request
from tests.support.door_harness import Harness, text_worker_harness
from tests.support.scripted_worker import MODEL, PLAIN, make_tokenizer
from tests.support.text_worker import TextWorker
from tests.support.waiting import wait_for

WEATHER = {"name": "get_weather", "description": "Weather now in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    tok = make_tokenizer()
    with text_worker_harness(tmp_path_factory.mktemp("ipc"), tok) as harness:
        yield harness


@pytest.fixture
def client(server: Harness) -> Iterator[Any]:   # the SDK's strict request types stay out of the way
    server.worker.step_seconds = 0.0
    yield anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)
    server.worker.step_seconds = 0.0
    wait_for(lambda: server.engine_load() == (0, 0, 0, 0), timeout=10.0, interval=0.01)   # nothing leaks


def spell(server: Harness, text: str) -> None:
    worker = server.worker
    assert isinstance(worker, TextWorker)
    worker.target = text
    worker.spelled.clear()


def post(server: Harness, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# -- text ---------------------------------------------------------------------------


def test_text_message_with_system_and_turns(client: Any, server: Harness) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=64, system="be brief",
                                 messages=[{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                                           {"role": "user", "content": [{"type": "text", "text": "again"}]}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == PLAIN
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    count = client.messages.count_tokens(model=MODEL, system="be brief",
                                         messages=[{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "hello"},
                                                   {"role": "user", "content": "again"}])
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == count.input_tokens > 0
    assert msg.usage.output_tokens > 0


def test_max_tokens_and_stop_sequences(client: Any) -> None:
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stopped = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["zzz", "tokens go"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "tokens go"
    assert stopped.content[0].text == PLAIN[:PLAIN.index("tokens go")]


def test_stream_events_and_the_sdk_helper(client: Any) -> None:
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == PLAIN and final.content[0].text == PLAIN
    events = list(client.messages.create(model=MODEL, max_tokens=64, messages=ASK, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[-2].delta.stop_reason == "end_turn"


def test_a_client_that_leaves_mid_stream_frees_its_request(server: Harness) -> None:
    cancelled = server.failures("CANCELLED", "anthropic")
    server.worker.step_seconds = 0.05
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/messages", method="POST",
        data=json.dumps({"model": MODEL, "max_tokens": 500, "messages": ASK, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=10)
    assert response.readline().startswith(b"event: message_start")
    response.close()
    wait_for(lambda: server.engine_load() == (0, 0, 0, 0), timeout=10.0, interval=0.01)
    server.worker.step_seconds = 0.0
    assert server.failures("CANCELLED", "anthropic") == cancelled + 1   # the metrics name its door


# -- tools ----------------------------------------------------------------------------


def test_tool_use_then_tool_result(client: Any, server: Harness) -> None:
    spell(server, call("get_weather", '{"city": "Paris"}'))
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    spell(server, "Sunny.")
    follow = client.messages.create(
        model=MODEL, max_tokens=50, tools=[WEATHER],
        messages=[*ASK, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}])
    assert follow.stop_reason == "end_turn" and follow.content[0].text == "Sunny."
    assert follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0) > msg.usage.input_tokens


def test_tool_use_streamed_as_input_json_deltas(client: Any, server: Harness) -> None:
    spell(server, call("get_weather", '{"city": "Paris"}'))
    events = list(client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                         tool_choice={"type": "any"}, stream=True))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, names", [
    ({"model": MODEL, "messages": ASK}, 400, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "messages[0].content[0].type"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [WEATHER]}, 400, "tool_choice"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "frequency": 1}, 400, "frequency"),
    ({"model": "other", "max_tokens": 5, "messages": ASK}, 404, "model"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]}, 400, "messages[0]"),
])
def test_errors_in_anthropics_shape(server: Harness, body: dict[str, Any], status: int, names: str) -> None:
    got, out = post(server, "/v1/messages", body)
    assert got == status, out
    assert out["type"] == "error" and out["error"]["type"] == {400: "invalid_request_error",
                                                               404: "not_found_error"}[status]
    assert out["error"]["message"].startswith(names), out
    assert server.engine_load() == (0, 0, 0, 0)


def test_sdk_raises_its_own_errors(client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert "max_tokens" in str(err.value)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="other", messages=ASK)


def test_keys_through_x_api_key(tmp_path: Path) -> None:
    from jitney.scheduler.api.http.middleware import _authenticate
    from jitney.scheduler.api.metrics import Metrics
    metrics = Metrics(lambda: None, key_label=True)
    middleware = _authenticate(_Keys({"s3cret": "alice"}), metrics)   # type: ignore[arg-type]
    from aiohttp.test_utils import make_mocked_request

    async def handler(request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"ok": request.get("jitney_api_key_name")})

    import asyncio
    ok = asyncio.run(middleware(make_mocked_request("POST", "/v1/messages", headers={"x-api-key": "s3cret"}),
                                handler))
    assert ok.status == 200
    bad = asyncio.run(middleware(make_mocked_request("POST", "/v1/messages", headers={"x-api-key": "nope"}),
                                 handler))
    assert bad.status == 401
    body = json.loads(bad.body)
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    openai_shape = asyncio.run(middleware(make_mocked_request("POST", "/v1/chat/completions"), handler))
    assert openai_shape.status == 401 and "error" in json.loads(openai_shape.body)
    assert json.loads(openai_shape.body)["error"]["code"] == "invalid_api_key"
    refused = {door: metrics.registry.get_sample_value(
        "jitney:request_failure_total", {"code": "UNAUTHENTICATED", "door": door, "key": ""})
        for door in ("anthropic", "openai", "responses")}
    assert refused == {"anthropic": 1.0, "openai": 1.0, "responses": None}


class _Keys:
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def identify(self, token: str | None) -> str | None:
        return self.names.get(token or "")


# -- translation ----------------------------------------------------------------------


def test_translation_of_blocks_and_tools() -> None:
    req = parse_messages_request({
        "model": MODEL, "max_tokens": 9, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "stop_sequences": ["x"], "top_k": 3, "metadata": {"user_id": "u1"}, "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Oslo"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "text", "text": "cold"}]},
                                                  {"type": "text", "text": "and tomorrow?"}]}]})
    chat = req.chat
    assert chat["messages"] == [
        {"role": "system", "content": "a\nb"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "cold"}, {"role": "user", "content": "and tomorrow?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters":
                                                                WEATHER["input_schema"],
                                                                "description": "Weather now in a city"}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["stop"], chat["top_k"], chat["user"], chat["max_completion_tokens"]) == (["x"], 3, "u1", 9)
    assert req.origins == ["system", "messages[0]", "messages[1]", "messages[2]", "messages[2]"]
    assert req.param("messages[3].tool_call_id") == "messages[2].tool_call_id"
    assert req.param("max_completion_tokens") == "max_tokens"
    assert req.param("tools[0].function.parameters") == "tools[0].input_schema"
    with pytest.raises(AnthropicError, match="thinking.budget_tokens"):
        parse_messages_request({"model": MODEL, "max_tokens": 9, "messages": ASK, "thinking": {"type": "enabled"}})


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_assembler_joins_split_tool_arguments_and_blocks(cut: int) -> None:
    args = '{"city": "Paris", "days": [1, 2]}'
    pieces = [args[i:i + cut] for i in range(0, len(args), cut)]
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "think"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me look."}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                              "function": {"name": "get_weather",
                                                                           "arguments": pieces[0]}}]},
                      "finish_reason": None}]},
        *({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]},
                        "finish_reason": None}]} for p in pieces[1:]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 11,
                                  "prompt_tokens_details": {"cached_tokens": 8}}},
    ]
    asm = MessageAssembler("msg_1", MODEL, 20)
    events = [e for c in chunks for e in asm.feed(c)] + asm.finish(None)
    message = asm.message(None)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2]["input"] == {"city": "Paris", "days": [1, 2]}
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 12, "output_tokens": 11, "cache_read_input_tokens": 8,
                                "cache_creation_input_tokens": 0}
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "input_json_delta")
    assert partial == args
    # Every event parses as the SDK's own type.
    from anthropic.types import RawMessageStreamEvent
    import pydantic
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    for event in events:
        adapter.validate_python(event)
