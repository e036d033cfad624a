"""The OpenAI-compatible HTTP API (``--openai-port``, scheduler/api/http/)
through the official ``openai`` client.

Fast and in-process: the scheduler's real pieces run in a background event
loop (``tests/support/door_harness.py``), and a scripted worker answers on
the other end of the sockets (``tests/support/scripted_worker.py``). Its plans
go through the real worker's checks (``tests/support/fake_worker.py``); its
"model" spells ``PLAIN`` then EOS, or, in a chunk the scheduler marks as
grammar-masked, ``JSON_DOC``, and it never samples a token the mask forbids.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from jitney.scheduler.main import SchedulerProcessConfig
from jitney.scheduler.core.detokenizer import TokenTexts
from jitney.scheduler.api.http.openai.protocol import ParsedRequest, openai_param, parse_request
from tests.support.door_harness import Harness
from tests.support.scripted_worker import BLOCK, MODEL, PLAIN, SEATS, SYSTEM, VOCAB, make_tokenizer
from tests.support.waiting import wait_for

MAX_QUEUED = 2                   # --max-queued-requests
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = Harness(tmp_path_factory.mktemp("ipc"), tokenizer, max_queued=MAX_QUEUED)
    try:
        harness.start_worker()
        yield harness
    finally:
        harness.close()


@pytest.fixture
def client(server: Harness) -> Iterator[openai.OpenAI]:
    server.worker.step_seconds = 0.0
    yield server.client
    server.worker.step_seconds = 0.0
    wait_for(lambda: server.engine_load() == (0, 0, 0, 0), timeout=10.0, interval=0.01)   # nothing leaks between tests


def plain_tokens(tokenizer: Any) -> list[int]:
    return tokenizer(PLAIN, add_special_tokens=False)["input_ids"]


def chat_prompt_len(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(out if isinstance(out, list) else out["input_ids"])    # transformers 4 / 5


MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "where to?"}]


# -- tests ------------------------------------------------------------------------


def test_the_flag_reaches_the_scheduler_process() -> None:
    from jitney.cli import build_parser
    from jitney.scheduler.launch.supervisor import child_argv

    parser = build_parser()
    serve = parser.parse_args(["serve", "--openai-port", "8000"])
    sched_parser = parser._subparsers._group_actions[0].choices["scheduler"]  # type: ignore[union-attr]
    argv = child_argv(sched_parser, serve)
    assert argv[argv.index("--openai-port") + 1] == "8000"
    cfg = SchedulerProcessConfig.from_namespace(sched_parser.parse_args(argv))
    assert cfg.openai_port == 8000
    assert SchedulerProcessConfig.from_namespace(parser.parse_args(["scheduler"])).openai_port == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--openai-port", "70000"])


def test_unavailable_before_ready_and_while_draining(tokenizer: Any, tmp_path: Path) -> None:
    harness = Harness(tmp_path, tokenizer, max_queued=MAX_QUEUED)
    try:
        for call in (harness.client.models.list,
                     lambda: harness.client.chat.completions.create(model=MODEL, messages=MESSAGES)):
            with pytest.raises(openai.InternalServerError) as err:
                call()
            assert err.value.status_code == 503
            assert "not ready" in err.value.message
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(f"http://127.0.0.1:{harness.port}/health", timeout=5)
        assert http_err.value.code == 503
        harness.start_worker()
        assert [m.id for m in harness.client.models.list().data] == [MODEL]
        harness.set_refusing("the server is draining (shutting down)")
        with pytest.raises(openai.InternalServerError) as err:
            harness.client.completions.create(model=MODEL, prompt="hi")
        assert err.value.status_code == 503 and "draining" in err.value.message
    finally:
        harness.close()


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [(m.id, m.owned_by, m.object) for m in models] == [(MODEL, "jitney", "model")]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.status_code == 404 and MODEL in err.value.message
    assert err.value.code == "model_not_found"


def test_chat_completion_usage_cache_and_logprobs(client: openai.OpenAI, tokenizer: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=7, temperature=0.5)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == MODEL
    (choice,) = reply.choices
    assert (choice.index, choice.message.role, choice.message.content) == (0, "assistant", PLAIN)
    assert choice.finish_reason == "stop"
    prompt_len = chat_prompt_len(tokenizer, MESSAGES)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.completion_tokens == len(plain_tokens(tokenizer)) + 1    # with the EOS
    assert reply.usage.total_tokens == prompt_len + reply.usage.completion_tokens

    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                           top_logprobs=2, max_completion_tokens=6)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // BLOCK * BLOCK > 0
    (choice,) = again.choices
    assert choice.finish_reason == "length" and again.usage.completion_tokens == 6
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for item, token in zip(content, plain_tokens(tokenizer)):
        assert item.token == tokenizer.decode([token]) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(-token / 1000)        # FakeWorker's logprob
        assert [t.token for t in item.top_logprobs][:1] == [item.token]
        assert [t.logprob for t in item.top_logprobs] == [-0.25, -1.25]


def test_text_completion(client: openai.OpenAI, tokenizer: Any) -> None:
    plain = plain_tokens(tokenizer)
    reply = client.completions.create(model=MODEL, prompt="the quick brown fox")
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    (choice,) = reply.choices
    # OpenAI's default max_tokens for completions: 16.
    assert choice.text == tokenizer.decode(plain[:16]) and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 16

    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=1)
    (choice,) = ids.choices
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in plain[:3]]
    assert choice.logprobs.text_offset == [0, len(choice.logprobs.tokens[0]),
                                           len("".join(choice.logprobs.tokens[:2]))]
    assert choice.logprobs.top_logprobs == [{t: -0.25} for t in choice.logprobs.tokens]

    stopped = client.completions.create(model=MODEL, prompt="go", max_tokens=50, stop=["tokens"],
                                        echo=True)
    assert stopped.choices[0].text == "go" + PLAIN[:PLAIN.index("tokens")]
    assert stopped.choices[0].finish_reason == "stop"


def test_streaming_chat_and_completion(client: openai.OpenAI, server: Harness, tokenizer: Any) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == PLAIN
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(plain_tokens(tokenizer)) + 1
    assert all(c.usage is None for c in chunks[:-1])

    parts = list(client.completions.create(model=MODEL, prompt="fox", max_tokens=4, stream=True))
    assert "".join(p.choices[0].text for p in parts) == tokenizer.decode(plain_tokens(tokenizer)[:4])
    assert parts[-1].choices[0].finish_reason == "length"

    # The wire format itself: server-sent events ending in data: [DONE].
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/completions", method="POST",
        data=json.dumps({"prompt": "fox", "max_tokens": 2, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        body = response.read().decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_n_samples(client: openai.OpenAI, tokenizer: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [PLAIN] * 3
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert reply.usage.completion_tokens == 3 * (len(plain_tokens(tokenizer)) + 1)

    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in client.completions.create(model=MODEL, prompt="fox", n=2, max_tokens=5, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finished[c.index] = c.finish_reason or finished.get(c.index)
    expected = tokenizer.decode(plain_tokens(tokenizer)[:5])
    assert texts == {0: expected, 1: expected} and finished == {0: "length", 1: "length"}


def test_json_schema_response(client: openai.OpenAI, server: Harness) -> None:
    before = server.worker.masked_samples
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "answer in JSON"}], max_tokens=40,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    (choice,) = reply.choices
    assert server.worker.masked_samples > before     # the worker sampled under the grammar's masks
    value = json.loads(choice.message.content or "")
    assert value == {"answer": "yes"} and choice.finish_reason == "stop"


def test_bad_requests(client: openai.OpenAI) -> None:
    def bad(**kwargs: Any) -> openai.BadRequestError:
        kwargs.setdefault("messages", MESSAGES)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, **kwargs)
        assert err.value.status_code == 400
        return err.value

    err = bad(temperature=-1)        # Jitney's own validation, named in OpenAI's terms
    assert err.param == "temperature" and "temperature" in err.message
    assert isinstance(err.body, dict) and err.body["type"] == "invalid_request_error"
    assert bad(max_completion_tokens=5000).param == "max_completion_tokens"
    assert bad(logit_bias={"99999": 1}).param == "logit_bias[99999]"
    assert bad(stop=[""]).param == "stop[0]"
    err = bad(functions=[{"name": "f", "parameters": {}}])
    assert err.param == "functions" and "not supported" in err.message
    err = bad(extra_body={"frobnicate": 1})
    assert err.param == "frobnicate" and "Unrecognized request argument" in err.message
    assert bad(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]).param == "messages[0].tool_call_id"
    assert bad(messages=[]).param == "messages"
    assert bad(top_logprobs=3).param == "top_logprobs"              # without logprobs
    assert bad(response_format={"type": "json_schema", "json_schema": {"name": "x"}}).param == \
        "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as err2:
        client.completions.create(model=MODEL, prompt=["one", "two"])
    assert err2.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err2:
        client.completions.create(model=MODEL, prompt=[VOCAB + 5])
    assert err2.value.param == "prompt[0]"


def test_json_schema_strict_false_asks_for_lenient_json(client: openai.OpenAI) -> None:
    def fmt(**spec: Any) -> Any:
        parsed = parse_request({"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, **spec}}}, chat=True)
        return parsed.params.response_format

    # Unset, null or true: compact output, closed objects (the gRPC default); false: lenient.
    assert [fmt(**spec).lenient_json for spec in ({}, {"strict": None}, {"strict": True}, {"strict": False})] == \
        [False, False, False, True]
    assert json.loads(fmt(strict=False).json_schema) == SCHEMA
    assert not parse_request({"messages": MESSAGES, "response_format": {"type": "json_object"}},
                             chat=True).params.response_format.lenient_json
    for strict in ("false", 0, 1, [True], {"strict": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, response_format={
                "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": strict}})
        assert err.value.status_code == 400
        assert err.value.param == "response_format.json_schema.strict", strict
        assert "response_format.json_schema.strict" in err.value.message
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}})
    assert json.loads(reply.choices[0].message.content or "") == {"answer": "yes"}
    assert reply.choices[0].finish_reason == "stop"


def test_cancelled_stream_frees_the_request(client: openai.OpenAI, server: Harness) -> None:
    server.worker.step_seconds = 0.01            # 400 tokens would take 4 s
    cancelled = server.failures("CANCELLED", "openai")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            max_tokens=400, extra_body={"ignore_eos": True})
    for _, chunk in zip(range(3), stream):
        pass
    assert server.engine_load()[0] == 1
    stream.close()
    started = time.monotonic()
    wait_for(lambda: server.engine_load() == (0, 0, 0, 0), timeout=3, interval=0.01)
    assert time.monotonic() - started < 2
    assert server.failures("CANCELLED", "openai") == cancelled + 1

    # A client that hangs up on a non-streamed request cancels it too.
    body = json.dumps({"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: server.engine_load()[0] == 1, timeout=3, interval=0.01)
    wait_for(lambda: server.engine_load() == (0, 0, 0, 0), timeout=3, interval=0.01)
    assert server.failures("CANCELLED", "openai") == cancelled + 2


def test_deadline_answers_504(client: openai.OpenAI, server: Harness) -> None:
    server.worker.step_seconds = 0.01
    slow = dict(model=MODEL, messages=MESSAGES, max_tokens=400, extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Timeout": "0.3"})
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(**slow)      # type: ignore[call-overload]
    assert err.value.status_code == 504 and "deadline" in err.value.message
    got = 0
    with pytest.raises(openai.APIError, match="deadline"):   # mid-stream: an error event
        for chunk in client.chat.completions.create(stream=True, **slow):  # type: ignore[call-overload]
            got += 1
    assert got > 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       extra_headers={"X-Request-Timeout": "soon"})


def test_queue_bound_answers_429(client: openai.OpenAI, server: Harness) -> None:
    server.worker.step_seconds = 0.01
    aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
    long = dict(model=MODEL, messages=MESSAGES, max_tokens=400, extra_body={"ignore_eos": True})

    async def body() -> list[Any]:
        running = [await aclient.chat.completions.create(stream=True, **long)  # type: ignore[call-overload]
                   for _ in range(SEATS)]       # headers come with the first token: all running
        waiting = [asyncio.create_task(aclient.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                       max_tokens=2))
                   for _ in range(MAX_QUEUED)]
        await asyncio.to_thread(wait_for, lambda: server.engine_load()[2] == MAX_QUEUED)
        with pytest.raises(openai.RateLimitError) as err:
            await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert err.value.status_code == 429 and "--max-queued-requests" in err.value.message
        for stream in running:
            await stream.close()
        results = await asyncio.gather(*waiting)
        await aclient.close()
        return results

    for reply in asyncio.run(body()):
        assert reply.choices[0].finish_reason == "length"


def test_parse_request_maps_every_argument() -> None:
    parsed = parse_request({
        "model": MODEL, "prompt": "hi", "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "n": 2,
        "stop": "x", "seed": 2**63, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": {"12": -100}, "logprobs": 3, "best_of": 2, "user": "u",
        "response_format": {"type": "json_object"}, "top_k": -1, "min_p": 0.1,
        "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [4],
        "priority": 5, "cache_salt": "tenant", "stream": True, "stream_options": {"include_usage": True},
        "suffix": None, "echo": False,
    }, chat=False)
    p, s = parsed.params, parsed.params.sampling
    assert p.text == "hi" and p.priority == 5 and p.cache_salt == "tenant"
    assert p.response_format.json_object
    assert (s.max_tokens, s.n, list(s.stop), s.seed, dict(s.logit_bias)) == (9, 2, ["x"], 2**63, {12: -100.0})
    assert (s.temperature, s.top_p, s.presence_penalty, s.frequency_penalty) == pytest.approx((0.7, 0.9, 0.5, -0.5))
    assert (s.top_logprobs, s.HasField("top_k"), s.top_k, s.min_tokens, s.ignore_eos, list(s.stop_token_ids)) == \
        (3, True, 0, 2, True, [4])
    assert (s.min_p, s.repetition_penalty) == pytest.approx((0.1, 1.2))
    assert parsed.stream and parsed.include_usage and parsed.logprobs and not parsed.echo

    chat = parse_request({"messages": [{"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "tool_calls": [], "refusal": None}],
        "max_completion_tokens": 4, "logprobs": True, "tools": [], "store": False}, chat=True)
    assert [(m.role, m.content) for m in chat.params.chat.messages] == [("system", "a\nb"), ("assistant", "c")]
    s = chat.params.sampling
    assert s.max_tokens == 4 and s.temperature == 1.0 and s.top_logprobs == 0 and chat.logprobs
    assert not s.HasField("n") and not chat.params.HasField("response_format")
    schema = parse_request({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}, chat=True)
    assert json.loads(schema.params.response_format.json_schema) == SCHEMA
    ids = parse_request({"prompt": [[1, 2, 3]]}, chat=False)
    assert list(ids.params.token_ids.ids) == [1, 2, 3] and ids.params.sampling.max_tokens == 16


def test_validation_fields_are_named_as_openai_arguments() -> None:
    chat = ParsedRequest(parse_request({"messages": [{"role": "user", "content": "x"}],
                                        "max_completion_tokens": 3}, chat=True).params, chat=True,
                         names={"max_tokens": "max_completion_tokens", "top_logprobs": "top_logprobs"})
    assert openai_param("params.sampling.max_tokens", chat) == "max_completion_tokens"
    assert openai_param("params.sampling.stop[2]", chat) == "stop[2]"
    assert openai_param("params.chat.messages[1].role", chat) == "messages[1].role"
    assert openai_param("params.chat.messages", chat) == "messages"
    assert openai_param("params.priority", chat) == "priority"
    completion = parse_request({"prompt": [1]}, chat=False)
    assert openai_param("params.sampling.top_logprobs", completion) == "logprobs"
    assert openai_param("params.token_ids.ids[0]", completion) == "prompt[0]"
    assert openai_param("params.text", completion) == "prompt"


def test_logprob_bytes_join_up_across_a_split_character(tokenizer: Any) -> None:
    text = "snow \u2603 caf\u00e9"       # no merges for these: one byte-level token per byte
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    token_text = TokenTexts(tokenizer)
    assert any(token_text(t) == "\ufffd" for t in ids)       # a piece of a character, alone
    assert bytes(b for t in ids for b in token_text.raw(t)).decode() == text
