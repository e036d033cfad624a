"""The Responses door's pure parts (scheduler/api/http/openai_responses/): request
items as a chat body, synthetic chat chunk sequences (in OpenAI's public chunk
shapes, tool-call deltas split at arbitrary points) as the Response object and
its events, each event checked against the official SDK's pydantic type, and
the SQLite store's bounds."""

from __future__ import annotations

import asyncio
import json
import random
import tracemalloc
import typing
from pathlib import Path
from typing import Any

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from jitney.scheduler.api.http.openai.protocol import APIError
from jitney.scheduler.api.http.openai_responses.events import ResponseAssembler, TranslationError
from jitney.scheduler.api.http.openai_responses.items import chat_messages
from jitney.scheduler.api.http.openai_responses.protocol import parse_create
from jitney.scheduler.api.http.openai_responses.routes import _renamed
from jitney.scheduler.api.http.openai_responses.store import ResponseStore, StoreConfig, StoreError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "weather", "description": "the weather", "parameters": SCHEMA,
        "strict": True}
EVENT_TYPES = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
USAGE = {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39,
         "prompt_tokens_details": {"cached_tokens": 16}}


def sdk_check(obj: dict[str, Any], cls: Any) -> None:
    """``obj`` validates as the SDK's ``cls``; the one field left out on purpose is
    usage's ``cache_write_tokens`` (Jitney does not count cache writes)."""
    try:
        cls.model_validate(obj)
    except pydantic.ValidationError as exc:
        errors = [e for e in exc.errors() if e["loc"][-1] != "cache_write_tokens"]
        assert errors == [], errors


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(**extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [], "usage": dict(USAGE, **extra)}


def run(chunks: list[dict[str, Any]], **create: Any) -> tuple[ResponseAssembler, list[dict[str, Any]]]:
    req = parse_create({"input": "hi", **create})
    assembler = ResponseAssembler("resp_abc", "m", req.echo, created_at=1)
    events = assembler.start()
    for c in chunks:
        events += assembler.feed(c)
    events += assembler.finish()
    for event in events:
        sdk_check(event, EVENT_TYPES[event["type"]])
    sdk_check(assembler.response(), Response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return assembler, events


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def call_chunks(index: int, call_id: str, name: str, arguments: str, rng: random.Random) -> list[dict[str, Any]]:
    """A tool call as chat streams it: id and name first (maybe with a first fragment), then fragments."""
    parts = split(arguments, rng)
    first = parts.pop(0) if rng.random() < 0.5 else ""
    out = [chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": first}}]})]
    out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]}) for p in parts]
    return out


# -- requests -----------------------------------------------------------------------


def test_items_become_chat_messages() -> None:
    req = parse_create({"instructions": "be kind", "input": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "},
                                     {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
    ]})
    calls = [{"id": c, "type": "function", "function": {"name": "weather", "arguments": a}}
             for c, a in (("c1", '{"city":"Paris"}'), ("c2", '{"city":"Rome"}'))]
    assert chat_messages(req.instructions, req.items) == [
        {"role": "system", "content": "be kind"}, {"role": "system", "content": "rules"},
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "checking", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}]


def test_a_call_output_must_answer_an_earlier_call() -> None:
    prior = parse_create({"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                                     "arguments": "{}"}]}).items
    new = parse_create({"input": [{"role": "user", "content": "x"},
                                  {"type": "function_call_output", "call_id": "c1", "output": "4"}]}).items
    assert chat_messages(None, prior + new, first_new=len(prior))[-1]["role"] == "tool"
    with pytest.raises(APIError) as err:
        chat_messages(None, new)
    assert err.value.param == "input[1].call_id"


def test_the_chat_body_and_the_echo() -> None:
    req = parse_create({"model": "m", "input": "hi", "tools": [TOOL], "tool_choice": {"type": "function",
                        "name": "weather"}, "parallel_tool_calls": False, "max_output_tokens": 50,
                        "temperature": 0.5, "top_p": 0.9, "user": "u", "metadata": {"a": "b"},
                        "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA,
                                            "strict": False}}, "store": False, "stream": True})
    assert req.chat_args == {
        "model": "m", "max_completion_tokens": 50, "temperature": 0.5, "top_p": 0.9, "user": "u",
        "tools": [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                                    "parameters": SCHEMA, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                   "strict": False}}}
    assert (req.stream, req.store) == (True, False)
    assert req.echo["tools"] == [TOOL] and req.echo["tool_choice"] == {"type": "function", "name": "weather"}
    assert req.echo["text"]["format"]["name"] == "w" and req.echo["metadata"] == {"a": "b"}
    plain = parse_create({"input": "hi", "tool_choice": "none", "text": {"format": {"type": "json_object"}}})
    assert plain.chat_args == {"response_format": {"type": "json_object"}}   # no tools: no tool arguments


def test_chat_path_errors_are_renamed() -> None:
    def renamed(param: str) -> str | None:
        return _renamed(APIError(400, f"{param}: bad", param=param)).param

    assert renamed("max_completion_tokens") == "max_output_tokens"
    assert renamed("messages[3].content") == "input"
    assert renamed("response_format.json_schema.schema") == "text.format.schema"
    assert renamed("tools[1].function.parameters") == "tools[1].parameters"
    assert renamed("tool_choice.function.name") == "tool_choice.name"
    assert renamed("temperature") == "temperature"
    assert _renamed(APIError(400, "max_completion_tokens: too many",
                             param="max_completion_tokens")).message == "max_output_tokens: too many"


# -- chunks -> events ---------------------------------------------------------------


def test_text_chunks() -> None:
    assembler, events = run([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
                             chunk({"content": "lo"}), chunk(finish="stop"), usage_chunk()])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {"input_tokens": 30, "output_tokens": 9, "total_tokens": 39,
                              "input_tokens_details": {"cached_tokens": 16},
                              "output_tokens_details": {"reasoning_tokens": 0}}
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"


def test_length_is_incomplete() -> None:
    _, events = run([chunk({"content": "Hel"}), chunk(finish="length"), usage_chunk()])
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize("seed", range(8))
def test_reasoning_text_and_parallel_tool_calls(seed: int) -> None:
    rng = random.Random(seed)
    args = [json.dumps({"city": "Paris", "days": [1, 2]}), json.dumps({"city": "Rome \u00e9\"x"})]
    chunks = [chunk({"role": "assistant"})]
    chunks += [chunk({"reasoning_content": p}) for p in split("let me think", rng)]
    chunks += [chunk({"content": p}) for p in split("Checking both.", rng)]
    chunks += call_chunks(0, "call_a", "weather", args[0], rng) + call_chunks(1, "call_b", "weather", args[1], rng)
    chunks += [chunk(finish="tool_calls"), usage_chunk(completion_tokens_details={"reasoning_tokens": 3})]
    assembler, events = run(chunks, tools=[TOOL])
    out = events[-1]["response"]["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in out[2:]] == \
        [("call_a", "weather", args[0]), ("call_b", "weather", args[1])]
    for index in (2, 3):       # the fragments concatenate to the arguments; .done carries them whole
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == index]
        (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"
                   and e["output_index"] == index]
        assert "".join(deltas) == done["arguments"] == out[index]["arguments"]
    # Items never interleave: each one's events lie between its added and done.
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2, 3]
    assert events[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert all(i["status"] == "completed" for i in out)


def test_failure_mid_call() -> None:
    req = parse_create({"input": "hi"})
    assembler = ResponseAssembler("resp_abc", "m", req.echo)
    events = assembler.start()
    events += assembler.feed(call_chunks(0, "call_a", "weather", '{"city": "Pa', random.Random(1))[0])
    events += assembler.fail("the deadline passed", "server_error")
    assert [e["type"] for e in events[-4:]] == ["response.function_call_arguments.done",
                                                "response.output_item.done", "error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                               "message": "the deadline passed"}
    assert failed["output"][0]["status"] == "incomplete"
    for event in events:
        sdk_check(event, EVENT_TYPES[event["type"]])


@pytest.mark.parametrize("chunks", [
    [chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})],        # no id nor name
    [chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f"}}]}), chunk({"content": "x"}),
     chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})],        # after the next item
    [{"choices": [{"index": 1, "delta": {"content": "x"}}]}],                         # a second choice
])
def test_malformed_chunks_are_refused(chunks: list[dict[str, Any]]) -> None:
    assembler = ResponseAssembler("resp_abc", "m", {})
    with pytest.raises(TranslationError):
        for c in chunks:
            assembler.feed(c)


# -- the store ----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored_response(i: int, pad: int = 0) -> dict[str, Any]:
    return {"id": f"resp_{i}", "object": "response", "pad": "x" * pad}


def test_store_bounds_and_restart(tmp_path: Path) -> None:
    clock = Clock()

    async def scenario() -> None:
        store = ResponseStore(StoreConfig(tmp_path, max_bytes=3000, max_age_s=100.0), clock)
        try:
            for i in range(3):
                assert await store.put(stored_response(i, pad=800), [{"type": "message", "i": i}])
                clock.now += 10
            assert (await store.stats())[0] == 3
            assert await store.put(stored_response(3, pad=800), [])       # over 3000 bytes: resp_0 goes
            assert await store.get("resp_0") is None and await store.get("resp_1") is not None
            assert not await store.put(stored_response(9, pad=4000), [])  # alone over the cap: not stored
            assert await store.get("resp_9") is None
            clock.now += 85        # resp_1 (stored at 1010) is now past 100 s: unseen, then evicted
            assert await store.get("resp_1") is None and await store.get("resp_2") is not None
            assert await store.put(stored_response(4), [])
            count, size = await store.stats()
            assert count == 3 and size <= 3000
            assert await store.delete("resp_4") and not await store.delete("resp_4")
        finally:
            store.close()
        again = ResponseStore(StoreConfig(tmp_path, max_bytes=3000, max_age_s=100.0), clock)
        try:               # a restart loses nothing, and knows the stored bytes
            found = await again.get("resp_3")
            assert found is not None and found.response["pad"] == "x" * 800
            assert (await again.stats())[0] == 2 and again._total == (await again.stats())[1]
        finally:
            again.close()

    asyncio.run(scenario())
    assert (tmp_path / "responses.sqlite3").exists()


def test_an_unusable_store_folder_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError) as err:
        ResponseStore(StoreConfig(blocker / "store"))
    assert str(blocker) in str(err.value)


def test_memory_does_not_grow_with_stored_responses(tmp_path: Path) -> None:
    async def scenario() -> int:
        store = ResponseStore(StoreConfig(tmp_path))
        try:
            for i in range(20):                                   # warm up (statement cache, thread)
                await store.put(stored_response(i, pad=20_000), [])
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for i in range(20, 320):                              # 6 MB more stored
                await store.put(stored_response(i, pad=20_000), [{"type": "message", "i": i}])
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            assert (await store.stats())[0] == 320
            return grown
        finally:
            store.close()

    assert asyncio.run(scenario()) < 512 * 1024
