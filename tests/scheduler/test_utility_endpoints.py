"""vLLM's /tokenize, /detokenize and /version on the OpenAI door
(scheduler/api/http/openai/utility.py), in process over a scripted worker
(tests/support/door_harness.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import jitney
from tests.support.door_harness import Harness
from tests.support.scripted_worker import MODEL, READY, make_tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = Harness(tmp_path_factory.mktemp("ipc"), make_tokenizer())
    try:
        harness.start_worker()
        yield harness
    finally:
        harness.close()


def call(server: Harness, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data,
                                     method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_version(server: Harness) -> None:
    assert call(server, "/version") == (200, {"version": jitney.__version__})


def test_tokenize_a_prompt_and_back(server: Harness) -> None:
    tok = server.tokenizer
    status, out = call(server, "/tokenize", {"model": MODEL, "prompt": "the quick fox",
                                             "return_token_strs": True})
    expected = list(tok("the quick fox", add_special_tokens=True)["input_ids"])
    assert status == 200
    assert out == {"count": len(expected), "max_model_len": READY.context_length, "tokens": expected,
                   "token_strs": tok.convert_ids_to_tokens(expected)}
    assert call(server, "/detokenize", {"tokens": expected}) == (200, {"prompt": tok.decode(expected)})


def test_tokenize_messages_as_the_chat_path_renders_them(server: Harness) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, out = call(server, "/tokenize", {"messages": messages})
    text = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = server.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert status == 200 and out["tokens"] == list(expected) and out["token_strs"] is None
    # The chat path's own usage agrees.
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == out["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False},
     400, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "temperature": 1}, 400, "temperature"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [READY.vocab_size]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_bad_requests_name_the_argument(server: Harness, path: str, body: dict[str, Any], status: int,
                                        param: str) -> None:
    got, out = call(server, path, body)
    assert got == status, out
    assert out["error"]["param"] == param, out
    assert server.engine_load() == (0, 0, 0, 0)
