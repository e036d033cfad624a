"""A Gemma-style chat template (``<start_of_turn>user\\n...<end_of_turn>\\n
<start_of_turn>model\\n``) through the chat path: its turn markers are
tokenized as single special ids, and ``<end_of_turn>``, listed in the model
folder's generation_config.json next to the base EOS (as Gemma's does),
ends a generation.

The stop ids are the worker loader's (``source_facts`` of a folder with the
tokenizer, a config and a generation config); the scheduler and both doors
run in this process (tests/support/door_harness.py) with the scripted worker
announcing those ids in its Ready.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jitney.common.model_files import resolve_model
from jitney.engine.v1 import engine_pb2
from jitney.v1 import generation_pb2 as pb
from jitney.worker.loading.loader import load_hf_config, source_facts
from tests.support.door_harness import Harness
from tests.support.scripted_worker import EOS, MODEL, READY, VOCAB, make_tokenizer

TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Gemma 2's template, less its refusal of system turns.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer(TURN_TOKENS)
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def turn_id(tokenizer: Any, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


@pytest.fixture(scope="module")
def stop_ids(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, ...]:
    """The loader's EOS ids of a folder whose generation config lists the base EOS and <end_of_turn>."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("gemma-like")
    tokenizer.save_pretrained(str(folder))
    LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, eos_token_id=EOS).save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [EOS, turn_id(tokenizer, "<end_of_turn>")]}))
    (folder / "model.safetensors").write_bytes(b"")   # resolve_model wants one; nothing reads it
    files = resolve_model(folder)
    return source_facts(files, load_hf_config(files)).eos_token_ids


@pytest.fixture(scope="module")
def server(tokenizer: Any, stop_ids: tuple[int, ...], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Harness]:
    ready = engine_pb2.Ready()
    ready.CopyFrom(READY)
    ready.eos_token_ids[:] = stop_ids
    harness = Harness(tmp_path_factory.mktemp("ipc"), tokenizer, ready=ready)
    try:
        harness.start_worker()
        yield harness
    finally:
        harness.close()


def test_the_generation_configs_end_of_turn_is_a_stop_id(tokenizer: Any, stop_ids: tuple[int, ...]) -> None:
    assert stop_ids == (EOS, turn_id(tokenizer, "<end_of_turn>"))


def test_turn_markers_are_single_special_ids(server: Harness, tokenizer: Any) -> None:
    start, end = (turn_id(tokenizer, t) for t in TURN_TOKENS)
    assert {start, end} < set(range(VOCAB)) and {start, end} <= set(tokenizer.all_special_ids)
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="where to?")])
    ids = list(server.stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=20).token_ids)

    def text(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False)["input_ids"])

    bos = turn_id(tokenizer, tokenizer.bos_token)
    assert ids == [bos, start, *text("user\nwhere to?"), end, *text("\n"), start, *text("model\n")]


def test_end_of_turn_stops_the_generation(server: Harness, tokenizer: Any) -> None:
    words = list(tokenizer("hello jitney", add_special_tokens=False)["input_ids"])
    # The script goes on past <end_of_turn>: only the stop ids end it there.
    server.worker.plain = [*words, turn_id(tokenizer, "<end_of_turn>"), *words, EOS]
    reply = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "where to?"}], max_tokens=50)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == len(words) + 1
    assert reply.choices[0].message.content == "hello jitney"
