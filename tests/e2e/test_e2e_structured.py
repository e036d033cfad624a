"""Structured output end to end: `jitney serve --openai-port P` with the
default model (SmolLM2-135M-Instruct), constrained requests over gRPC.

Each ResponseFormat kind once (json_schema greedy and sampled, json_object,
regex, choice, an EBNF grammar), the INVALID_ARGUMENT answers to formats that
do not compile, a constrained output cut by max_tokens, and constrained and
unconstrained requests in one batch; and the README's two structured-output
examples as a user runs them (`jitney generate --json-schema`, the OpenAI
client's json_object), which once streamed whitespace and repeated keys until
the context was full. Outputs are short and few: the module runs in well
under a minute on 2 CPU cores, most of it the server's start.
The greedy and seeded outputs are batch-invariant on the CPU, so a request's
output alone is also its output in a batch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import pytest

from tests.support.server_harness import ROOT, Server, free_port, running_server
from jitney.client.client import Sampling, make_params, response_format
from jitney.v1 import generation_pb2 as pb
from tests.support.waiting import wait_idle
from tests.support.json_whitespace import free_whitespace

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": ["string", "null"], "maxLength": 20},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b", "c"]}},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA_PROMPT = "Describe a fictional person as a JSON object with name, age and city."
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}

REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = '''root ::= greeting " " name "!"
greeting ::= "Hello" | "Hi"
name ::= [A-Z] [a-z]{1,10}
'''
GRAMMAR_AS_REGEX = r"(Hello|Hi) [A-Z][a-z]{1,10}!"


OPENAI_PORT = free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model with the OpenAI door open, as the README starts it (its own
    server: the session's shared default_server has no --openai-port)."""
    with running_server(["--openai-port", str(OPENAI_PORT)], tmp_path_factory.mktemp("structured")) as srv:
        yield srv


def params(prompt: str, constraint: pb.ResponseFormat | None, max_tokens: int, **sampling: Any) -> pb.GenerationParams:
    return make_params(prompt, chat=True, constraint=constraint,
                       sampling=Sampling(max_tokens=max_tokens, **sampling))


def generate(server: Server, p: pb.GenerationParams) -> pb.GenerateResponse:
    return server.stub().Generate(pb.GenerateRequest(params=p), timeout=120)


def generate_all(server: Server, ps: list[pb.GenerationParams]) -> list[pb.GenerateResponse]:
    """All at once (one batch), replies in order."""
    stub = server.stub()
    futures = [stub.Generate.future(pb.GenerateRequest(params=p), timeout=120) for p in ps]
    return [f.result() for f in futures]


def json_params(max_tokens: int = 60, **sampling: Any) -> pb.GenerationParams:
    return params(SCHEMA_PROMPT, response_format(json_schema=json.dumps(SCHEMA)), max_tokens, **sampling)


def regex_params() -> pb.GenerationParams:
    return params("Give me a phone number like 555-1234.", response_format(regex=REGEX), 12)


def choice_params() -> pb.GenerationParams:
    return params("What color is the sky?", response_format(choices=CHOICES), 6)


def free_params() -> pb.GenerationParams:
    return params("Write a haiku about the sea.", None, 12, ignore_eos=True)


def assert_valid_json(reply: pb.GenerateResponse) -> None:
    assert reply.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE, reply
    jsonschema.validate(json.loads(reply.text), SCHEMA)


def assert_regex(reply: pb.GenerateResponse) -> None:
    assert reply.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE, reply
    assert re.fullmatch(REGEX, reply.text), reply.text


def assert_choice(reply: pb.GenerateResponse) -> None:
    assert reply.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE, reply
    assert reply.text in CHOICES, reply.text


@pytest.fixture(scope="module")
def json_alone(server: Server) -> tuple[pb.GenerateResponse, pb.GenerateResponse]:
    """The schema's greedy and sampled outputs (sent together)."""
    greedy, sampled = generate_all(server, [json_params(), json_params(**SAMPLED)])
    return greedy, sampled


def test_json_schema_greedy_and_sampled_validate(json_alone: tuple[pb.GenerateResponse, pb.GenerateResponse]) -> None:
    greedy, sampled = json_alone
    assert_valid_json(greedy)
    assert_valid_json(sampled)
    assert greedy.usage.completion_tokens == len(greedy.token_ids) > 0
    # The EOS id that ended it is the last token (the text is the document alone).
    assert greedy.text.rstrip().endswith("}")


def test_json_object_is_an_object(server: Server) -> None:
    reply = generate(server, params("Give a JSON object with a name and a color.",
                                    response_format(json_object=True), 60))
    assert reply.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE, reply
    assert isinstance(json.loads(reply.text), dict)


def test_regex_and_choice_match_exactly(server: Server) -> None:
    regex, choice = generate_all(server, [regex_params(), choice_params()])
    assert_regex(regex)
    assert_choice(choice)


def test_ebnf_grammar(server: Server) -> None:
    reply = generate(server, params("Greet someone by name.", response_format(grammar=GRAMMAR), 16))
    assert reply.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE, reply
    assert re.fullmatch(GRAMMAR_AS_REGEX, reply.text), reply.text


@pytest.mark.parametrize("constraint, field, message", [
    (response_format(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}})),
     "params.response_format.json_schema", "Invalid type: strin"),
    (response_format(json_schema=json.dumps({"type": "array", "uniqueItems": True})),
     "params.response_format.json_schema", "Unimplemented keys: [\"uniqueItems\"]"),
    (response_format(json_schema="{not json"), "params.response_format.json_schema", "not JSON"),
    (response_format(regex="(ab"), "params.response_format.regex", "unclosed group"),
    (response_format(grammar="root ::= missing"), "params.response_format.grammar", "Rule 'missing' not found"),
], ids=["schema-type", "schema-unsupported", "schema-not-json", "regex", "grammar"])
def test_invalid_format_is_invalid_argument(server: Server, constraint: pb.ResponseFormat, field: str,
                                            message: str) -> None:
    for stream in (False, True):
        with pytest.raises(grpc.RpcError) as err:
            p = params("Hi", constraint, 4)
            if stream:
                list(server.stub().GenerateStream(pb.GenerateStreamRequest(params=p), timeout=60))
            else:
                generate(server, p)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details() and message in err.value.details(), err.value.details()


def test_constrained_output_cut_by_max_tokens_ends_length(
        server: Server, json_alone: tuple[pb.GenerateResponse, pb.GenerateResponse]) -> None:
    reply = generate(server, json_params(max_tokens=5))
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(reply.token_ids) == reply.usage.completion_tokens == 5
    # The first five tokens of the full greedy output: a prefix, not a document.
    assert list(reply.token_ids) == list(json_alone[0].token_ids[:5])
    with pytest.raises(ValueError):
        json.loads(reply.text)


def test_constrained_and_unconstrained_in_one_batch(
        server: Server, json_alone: tuple[pb.GenerateResponse, pb.GenerateResponse]) -> None:
    free_alone = generate(server, free_params())
    batch = [json_params(), json_params(**SAMPLED), regex_params(), choice_params(), free_params(),
             params("Write a haiku about the sea.", None, 12, ignore_eos=True, **SAMPLED)]
    with ThreadPoolExecutor(2) as pool:   # streams too, alongside the unary calls
        streamed = pool.submit(lambda: list(server.stub().GenerateStream(
            pb.GenerateStreamRequest(params=regex_params()), timeout=120)))
        greedy, sampled, regex, choice, free, free_sampled = generate_all(server, batch)
        stream_msgs = streamed.result()
    assert_valid_json(greedy)
    assert_valid_json(sampled)
    assert_regex(regex)
    assert_choice(choice)
    # Batch-invariant: each output is the one it has alone.
    assert list(greedy.token_ids) == list(json_alone[0].token_ids)
    assert list(sampled.token_ids) == list(json_alone[1].token_ids)
    assert list(free.token_ids) == list(free_alone.token_ids)
    assert free.finish_reason == free_sampled.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(free_sampled.token_ids) == 12
    assert "".join(m.text for m in stream_msgs) == regex.text
    assert stream_msgs[-1].finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE
    stats = wait_idle(server)
    assert (stats.kv_blocks_used, stats.requests_running, stats.requests_waiting) == (0, 0, 0)
    assert stats.grammar_masked_steps > 0 and stats.grammar_mask_seconds > 0


def test_kv_blocks_back_to_zero(server: Server) -> None:
    stats = wait_idle(server)
    assert (stats.kv_blocks_used, stats.requests_running, stats.requests_waiting) == (0, 0, 0)


def test_sampled_choice_whatever_the_seed(server: Server) -> None:
    """Seed 72 at this prompt's first sampled position once drew U = 1 for a
    token outside the grammar (infinite noise on a -inf logit: NaN, INTERNAL)."""
    reply = generate(server, params("What color is the sky?", response_format(choices=CHOICES), 6,
                                    temperature=0.8, seed=72))
    assert reply.usage.prompt_tokens == 36      # the position the seed was chosen for
    assert_choice(reply)


# -- the README's examples ------------------------------------------------------------------

README_SCHEMA = ('{"type":"object","properties":{"city":{"type":"string"},"country":{"type":"string"}},'
                 '"required":["city","country"]}')
HANG_GUARD_S = 60     # a runaway took 391 s; these take a few seconds


def jitney_generate(server: Server, *args: str) -> tuple[str, float]:
    """`jitney generate ... --target` as a subprocess: (stdout, seconds)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "jitney.cli", "generate", *args, "--target", server.target],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S * 2)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    return done.stdout, elapsed


def test_readme_cli_json_schema_example(server: Server) -> None:
    args = ["Name a city and its country.", "--chat", "--json-schema", README_SCHEMA]
    shown, elapsed = jitney_generate(server, *args)                    # as the README runs it
    assert elapsed < HANG_GUARD_S
    doc = shown.removesuffix("\n")
    jsonschema.validate(json.loads(doc), json.loads(README_SCHEMA))
    assert free_whitespace(doc) == [] and doc.startswith('{"city": "') and "\n" not in doc
    assert set(json.loads(doc)) == {"city", "country"}                # closed: no other keys
    result, elapsed = jitney_generate(server, *args, "--json")
    assert elapsed < HANG_GUARD_S
    reply = json.loads(result)
    assert reply["finish_reason"] == "end_of_sequence" and reply["text"] == doc    # greedy: the same
    assert reply["usage"]["completion_tokens"] < 64


def test_cli_lenient_json_lets_whitespace_back(server: Server) -> None:
    """--lenient-json reaches the grammar: the same greedy request, now free to lay
    the document out, does (this model opens with a newline and an indent)."""
    result, _ = jitney_generate(server, "Name a city and its country.", "--chat", "--json-schema", README_SCHEMA,
                                "--lenient-json", "--max-tokens", "8", "--json")
    reply = json.loads(result)
    assert reply["finish_reason"] == "length" and len(reply["token_ids"]) == 8
    assert free_whitespace(reply["text"]), reply["text"]
    done = subprocess.run([sys.executable, "-m", "jitney.cli", "generate", "x", "--regex", "a+", "--lenient-json",
                           "--target", server.target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--lenient-json goes with --json-schema or --json-object" in done.stderr


def test_readme_openai_json_object_example(server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{OPENAI_PORT}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    readme = dict(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=32,
                  response_format={"type": "json_object"})
    # Greedy: one output, which must be a whole compact object.
    started = time.monotonic()
    reply = client.chat.completions.create(temperature=0, **readme)  # type: ignore[call-overload]
    assert time.monotonic() - started < HANG_GUARD_S
    (choice,) = reply.choices
    text = choice.message.content or ""
    assert choice.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), {"type": "object"})
    assert free_whitespace(text) == [], text
    # As the README has it (temperature 1, a seed drawn per request): whatever is drawn,
    # compact and quick; an output that stopped is an object, one that did not is 32 tokens.
    started = time.monotonic()
    for _ in range(4):
        reply = client.chat.completions.create(**readme)  # type: ignore[call-overload]
        (choice,) = reply.choices
        text = choice.message.content or ""
        assert free_whitespace(text) == [], text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length" and reply.usage is not None
            assert reply.usage.completion_tokens == 32
    assert time.monotonic() - started < HANG_GUARD_S
