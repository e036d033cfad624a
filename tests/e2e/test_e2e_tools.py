"""Tool calling end to end on the default model (SmolLM2-135M-Instruct, whose chat
template has no tool support: the generic format). A named call and a required one
give arguments valid against the tool's schema, through the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.server_harness import Server, free_port, running_server

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 16}},
                                               "required": ["city"]}}}]
OPENAI_PORT = free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(["--openai-port", str(OPENAI_PORT)], tmp_path_factory.mktemp("tools")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{OPENAI_PORT}/v1", api_key="unused", timeout=120,
                       max_retries=0) as c:
        yield c


def test_named_call_has_schema_valid_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=160, temperature=0,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [tc] = choice.message.tool_calls or []
    assert tc.function.name == "get_weather"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER)


def test_required_streamed_call_matches_its_fragments(client: openai.OpenAI) -> None:
    args, name, finish = "", "", None
    for chunk in client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=160, temperature=0, stream=True,
            messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and name in ("get_weather", "get_time")
    json.loads(args)
