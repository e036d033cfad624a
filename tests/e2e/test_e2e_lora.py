"""LoRA adapters end to end: one real `jitney serve` (the scheduler and the
worker processes) on a tiny random Llama, with random adapters saved by PEFT
itself (tests/support/tiny_lora.py), through the OpenAI door.

The server (tests/support/lora_server.py) is started by the README's "LoRA
adapters" command (`--max-loras 2`, two `--lora-modules`), its
`/adapters/NAME` folders replaced by this test's adapters and `--model` (the
tiny Llama), `--dtype float32` and a small cache added; that section's other
commands run as the README shows them and must print what it shows
(`python tests/e2e/test_readme.py --write` regenerates the shown outputs of
both README sections).

* base and adapter requests streamed at once: each adapter's greedy tokens
  are PEFT's on transformers (fp32; the same model folder the server serves),
  the base model's are transformers' own, and every adapter changes them;
* a third adapter with both slots held by running requests: its request
  waits (never fails), and boards once a slot is freed, its load evicting
  an adapter while the other runs on;
* an unload: new requests get 404 `model_not_found`, a running one finishes;
* bad adapters: 400 naming `lora_path`, the server unchanged (a request
  running meanwhile, the listed models);
* `/v1/models` lists the adapters with their `parent`, `/tokenize` takes an
  adapter's name.

A token is compared by its bytes (the chat stream's `logprobs.content[].bytes`,
against the same `TokenTexts` of the reference's ids), since the OpenAI door
returns no token ids.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from jitney.scheduler.core.detokenizer import TokenTexts
from tests.support.lora_server import ADAPTERS, LORA_EXAMPLES, SERVE, Lora, lora_server, run_readme
from tests.support.readme_examples import mismatch
from tests.support.tiny_lora import peft_reference
from tests.support.waiting import wait_for, wait_idle

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
SHORT = 8          # tokens compared with the references
LONG = 2000        # a request that holds its slot until the test stops it
UNLOADED = 96      # a request still running when its adapter is unloaded (a few ms after its first token)


class ChatStream:
    """A streamed greedy chat completion, read on a thread: each token's bytes as
    they come. ``stop()`` closes it early (the server cancels the request)."""

    def __init__(self, lora: Lora, model: str, max_tokens: int) -> None:
        self.tokens: list[bytes] = []
        self.finish: str | None = None
        self.error: Exception | None = None
        self.first, self.done, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._read, args=(lora, model, max_tokens), daemon=True)
        self._thread.start()

    def _read(self, lora: Lora, model: str, max_tokens: int) -> None:
        try:
            with lora.client() as client, client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=True,
                    logprobs=True, extra_body={"ignore_eos": True}) as stream:
                for chunk in stream:
                    for choice in chunk.choices:
                        if choice.logprobs is not None and choice.logprobs.content:
                            self.tokens += [bytes(t.bytes or []) for t in choice.logprobs.content]
                            self.first.set()
                        self.finish = choice.finish_reason or self.finish
                    if self._stop.is_set():
                        break
        except Exception as exc:     # the test asserts on it
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    def stop(self, after: int = SHORT) -> ChatStream:
        """Close it once it has ``after`` tokens (those the references check)."""
        wait_for(lambda: len(self.tokens) >= after or self.done.is_set(), timeout=60, what="a stream stalled")
        self._stop.set()
        return self.join()

    def join(self, timeout: float = 120.0) -> ChatStream:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a stream did not end"
        return self


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lora]:
    with lora_server(tmp_path_factory.mktemp("lora")) as server:
        yield server


@pytest.fixture(scope="module")
def expected(lora: Lora) -> dict[str, list[bytes]]:
    """Each model's first SHORT greedy tokens (bytes) from transformers (+ PEFT), fp32,
    on the prompt ids the server's /tokenize gives for the chat."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    status, tokenized = lora.post("/tokenize", {"model": lora.base, "messages": MESSAGES})
    assert status == 200, tokenized
    ids = tokenized["tokens"]
    texts = TokenTexts(AutoTokenizer.from_pretrained(str(lora.model)))
    models = {lora.base: AutoModelForCausalLM.from_pretrained(str(lora.model), dtype=torch.float32).eval()}
    models.update({name: peft_reference(lora.model, lora.adapters[name]) for name in ("sql", "chat", "math")})
    return {name: [bytes(texts.raw(t)) for t in _greedy(model, ids, SHORT)] for name, model in models.items()}


def _greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):      # no EOS stop: the server's requests ignore it too
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.fixture
def idle(lora: Lora) -> Iterator[Lora]:
    yield lora
    stats = wait_idle(lora.server)
    assert (stats.requests_running, stats.requests_waiting, stats.kv_blocks_used) == (0, 0, 0), stats


def test_the_lora_section_has_its_examples() -> None:
    assert len(SERVE) == 1
    runs = [ex for ex in LORA_EXAMPLES if ex not in SERVE]
    assert len(runs) >= 2 and all(ex.shown is not None for ex in runs)
    assert {m for ex in LORA_EXAMPLES for m in re.findall(r"/adapters/([\w-]+)", ex.source)} <= set(ADAPTERS)


def test_models_lists_the_adapters_and_tokenize_takes_their_names(idle: Lora) -> None:
    models = idle.models()
    assert list(models) == [idle.base, "sql", "chat"]
    for name in ("sql", "chat"):
        assert (models[name]["parent"], models[name]["root"]) == (idle.base, str(idle.adapters[name]))
    base = idle.post("/tokenize", {"model": idle.base, "messages": MESSAGES})
    assert base[0] == 200 and idle.post("/tokenize", {"model": "sql", "messages": MESSAGES}) == base
    status, refused = idle.post("/tokenize", {"model": "math", "messages": MESSAGES})
    assert status == 404 and refused["error"]["code"] == "model_not_found"


def test_base_and_adapters_streamed_at_once_equal_transformers_and_peft(
        idle: Lora, expected: dict[str, list[bytes]]) -> None:
    names = [idle.base, "sql", "chat", idle.base, "sql"]
    streams = [ChatStream(idle, name, SHORT) for name in names]
    for name, stream in zip(names, streams):
        stream.join()
        assert stream.error is None and stream.finish == "length", (name, stream.error)
        assert stream.tokens == expected[name], name
    # the references differ, so the comparisons above told the models apart
    assert len({tuple(tokens) for tokens in expected.values()}) == len(expected)


def test_the_readme_lora_commands(idle: Lora) -> None:
    for ex in LORA_EXAMPLES:
        if ex in SERVE:
            continue
        actual = run_readme(ex, idle)
        if ex.shown is not None:
            problem = mismatch(ex, actual)
            assert problem is None, f"{ex.label}: the README and the program disagree " \
                                    f"(`python tests/e2e/test_readme.py --write` regenerates):\n{problem}"
    assert list(idle.models()) == [idle.base, "sql", "chat"]     # math loaded, then unloaded


def test_a_third_adapter_waits_for_a_slot_and_evicts_one_while_the_other_runs(
        idle: Lora, expected: dict[str, list[bytes]]) -> None:
    assert idle.post("/v1/load_lora_adapter", {"lora_name": "math", "lora_path": str(idle.adapters["math"])}) \
        == (200, "Success: LoRA adapter 'math' added successfully.")
    sql, chat = ChatStream(idle, "sql", LONG), ChatStream(idle, "chat", LONG)
    assert sql.first.wait(60) and chat.first.wait(60) and not sql.error and not chat.error
    math = ChatStream(idle, "math", SHORT)        # both slots are held: it waits
    wait_for(lambda: idle.server.stats().requests_waiting == 1, timeout=30, what="math's request never waited")
    assert not math.tokens and not math.done.is_set()
    assert not sql.done.is_set() and not chat.done.is_set()
    sql.stop(after=0)                             # frees a slot: math's load evicts sql
    math.join()
    assert math.error is None and math.finish == "length" and math.tokens == expected["math"]
    assert not chat.done.is_set(), "chat ran on through the eviction"
    chat.stop()
    assert chat.error is None and chat.tokens[:SHORT] == expected["chat"]
    again = ChatStream(idle, "sql", SHORT).join()       # sql is no longer resident: loaded again
    assert again.error is None and again.tokens == expected["sql"]
    assert "math" in idle.models()


def test_an_unload_refuses_new_requests_and_running_ones_finish(idle: Lora,
                                                               expected: dict[str, list[bytes]]) -> None:
    running = ChatStream(idle, "chat", UNLOADED)
    assert running.first.wait(60) and not running.error
    assert idle.post("/v1/unload_lora_adapter", {"lora_name": "chat"}) \
        == (200, "Success: LoRA adapter 'chat' removed successfully.")
    assert not running.done.is_set()
    with idle.client() as client, pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2)
    assert refused.value.code == "model_not_found"
    running.join()
    assert running.error is None and running.finish == "length" and len(running.tokens) == UNLOADED
    assert running.tokens[:SHORT] == expected["chat"]
    assert "chat" not in idle.models()
    assert idle.post("/v1/unload_lora_adapter", {"lora_name": "chat"})[0] == 404


@pytest.mark.parametrize("name, words", [("too-big", "above --max-lora-rank 16"),
                                         ("other-model", "another base model")])
def test_a_bad_adapter_is_refused_and_the_server_is_unchanged(idle: Lora, expected: dict[str, list[bytes]],
                                                              name: str, words: str) -> None:
    before = idle.models()
    running = ChatStream(idle, idle.base, LONG)
    assert running.first.wait(60)
    status, body = idle.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(idle.adapters[name])})
    assert status == 400 and body["error"]["param"] == "lora_path" and words in body["error"]["message"], body
    assert not running.done.is_set()
    running.stop()
    assert running.error is None and running.tokens[:SHORT] == expected[idle.base]
    assert idle.models() == before
    again = ChatStream(idle, "sql", SHORT).join()
    assert again.error is None and again.tokens == expected["sql"]
