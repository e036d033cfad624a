"""``chat_template_kwargs``: a chat request's extra chat-template variables
(scheduler/api/template_kwargs.py), through the shared validation and both
doors (the OpenAI door's argument, the gRPC ``ChatPrompt.chat_template_kwargs``).

The tokenizer is the scripted worker's byte-level BPE (ChatML specials) with
Qwen3's own chat template (tests/support/data/qwen3_chat_template.jinja, as
published with the Qwen3 models), whose ``enable_thinking=false`` opens the
assistant turn with an empty think block.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from jitney.scheduler.api.template_kwargs import MAX_KEYS, MAX_VALUE_CHARS
from jitney.scheduler.api.validation import ModelLimits, validate_generation
from jitney.scheduler.core.request import InvalidRequestError
from jitney.v1 import generation_pb2 as pb
from tests.support.door_harness import Harness
from tests.support.scripted_worker import MODEL, make_tokenizer

QWEN3_TEMPLATE = (Path(__file__).parent.parent / "support" / "data" / "qwen3_chat_template.jinja").read_text()
LIMITS = ModelLimits(vocab_size=320, context_length=1024)
MESSAGES = [{"role": "user", "content": "where to?"}]
OPENED = "<|im_start|>user\nwhere to?<|im_end|>\n<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_params(kwargs: str = "") -> pb.GenerationParams:
    p = pb.GenerationParams()
    for m in MESSAGES:
        p.chat.messages.add(**m)
    p.chat.chat_template_kwargs = kwargs
    p.sampling.max_tokens = 4
    return p


def prompt(tokenizer: Any, kwargs: str = "") -> list[int]:
    return list(validate_generation(chat_params(kwargs), tokenizer, LIMITS, new_seed=lambda: 0).prompt_token_ids)


# -- the shared validation ----------------------------------------------------------------


def test_enable_thinking_false_opens_the_turn_with_an_empty_think_block(tokenizer: Any) -> None:
    assert prompt(tokenizer) == ids(tokenizer, OPENED)
    assert prompt(tokenizer, '{"enable_thinking": false}') == ids(tokenizer, OPENED + EMPTY_THINK)
    assert prompt(tokenizer, '{"enable_thinking": true}') == ids(tokenizer, OPENED)


def test_integers_reach_the_template_as_integers(tokenizer: Any) -> None:
    tok = make_tokenizer()
    tok.chat_template = "{% for i in range(repeat) %}x{% endfor %}"
    assert prompt(tok, '{"repeat": 3}') == ids(tok, "xxx")


@pytest.mark.parametrize("kwargs, field, words", [
    ("[1]", "", "must be a JSON object, got list"),
    ("{nope", "", "must be a JSON object"),
    ('"s"', "", "must be a JSON object, got str"),
    ('{"messages": []}', ".messages", "set by the server's chat path"),
    ('{"add_generation_prompt": false}', ".add_generation_prompt", "set by the server's chat path"),
    ('{"tokenize": false}', ".tokenize", "set by the server's chat path"),
    ('{"chat_template": "{{ 1 }}"}', ".chat_template", "set by the server's chat path"),
    ('{"tools": []}', ".tools", "set by the server's chat path"),
    ('{"eos_token": "x"}', ".eos_token", "set by the server's chat path"),
    ('{"raise_exception": 1}', ".raise_exception", "set by the server's chat path"),
    ('{"not-a-name": 1}', "", "is not an identifier"),
    ('{"%s": 1}' % ("k" * 65), "", "is not an identifier"),
    (json.dumps({"big": "x" * MAX_VALUE_CHARS}), ".big", f"more than the limit {MAX_VALUE_CHARS}"),
    (json.dumps({f"k{i}": 1 for i in range(MAX_KEYS + 1)}), "", f"more than the limit {MAX_KEYS}"),
    ("[" * 50_000, "", "must be a JSON object: maximum recursion depth"),
    ("[" * 200_000, "", "characters, more than the limit"),
])
def test_rejected(tokenizer: Any, kwargs: str, field: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        prompt(tokenizer, kwargs)
    assert e.value.field == "params.chat.chat_template_kwargs" + field
    assert words in str(e.value)


def test_a_value_the_template_cannot_use_is_the_requests_error(tokenizer: Any) -> None:
    tok = make_tokenizer()
    tok.chat_template = "{{ messages[0].content }}{{ budget + 1 }}"
    with pytest.raises(InvalidRequestError) as e:
        prompt(tok, '{"budget": "lots"}')
    assert e.value.field == "params.chat.chat_template_kwargs" and "TypeError" in str(e.value)


# -- both doors ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = Harness(tmp_path_factory.mktemp("ipc"), tokenizer)
    try:
        harness.start_worker()
        yield harness
    finally:
        harness.close()


def test_openai_door(server: Harness, tokenizer: Any) -> None:
    def prompt_tokens(**extra: Any) -> int:
        reply = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                      **extra)  # type: ignore[call-overload]
        return int(reply.usage.prompt_tokens)

    assert prompt_tokens() == len(ids(tokenizer, OPENED))
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == \
        len(ids(tokenizer, OPENED + EMPTY_THINK))
    for value, param in (([1], "chat_template_kwargs"), ({"messages": []}, "chat_template_kwargs.messages"),
                         ({"a b": 1}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                  extra_body={"chat_template_kwargs": value})
        error = e.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert error["type"] == "invalid_request_error" and "chat_template_kwargs" in error["message"]
    with pytest.raises(openai.BadRequestError) as e:   # a completion has no chat template
        server.client.completions.create(model=MODEL, prompt="x",
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "unknown_parameter"


def test_grpc_door(server: Harness, tokenizer: Any) -> None:
    off = chat_params('{"enable_thinking": false}')
    assert list(server.stub.Tokenize(pb.TokenizeRequest(chat=off.chat), timeout=20).token_ids) == \
        ids(tokenizer, OPENED + EMPTY_THINK)
    reply = server.stub.Generate(pb.GenerateRequest(params=off), timeout=20)
    assert reply.usage.prompt_tokens == len(ids(tokenizer, OPENED + EMPTY_THINK))
    plain = server.stub.Generate(pb.GenerateRequest(params=chat_params()), timeout=20)
    assert plain.usage.prompt_tokens == len(ids(tokenizer, OPENED))
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(pb.GenerateRequest(params=chat_params('{"add_generation_prompt": false}')),
                             timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.chat.chat_template_kwargs.add_generation_prompt" in (e.value.details() or "")
