"""`jitney generate`: the whole answer in `--json` (every sample, logprobs
with token texts, prompt logprobs, usage), and n > 1 streamed sample after
sample; against one `jitney serve` on a tiny random model."""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server_harness import ROOT, Server, running_server
from tests.support.tiny_models import make_tiny_llama
from jitney.client.cli import _SampleRelay
from jitney.client.client import Sampling, make_params
from jitney.v1 import generation_pb2 as pb

PROMPT = "hello jitney, tokens go in"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model", str(model), "--num-blocks", "640", "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def jitney_generate(server: Server, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "jitney.cli", "generate", PROMPT, "--target", server.target,
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def unary(server: Server, **sampling: Any) -> pb.GenerateResponse:
    params = make_params(PROMPT, sampling=Sampling(**sampling))
    return server.stub().Generate(pb.GenerateRequest(params=params), timeout=60)


def check_alternatives(entries: list[dict[str, Any]], count: int, tokenizer: Any) -> None:
    assert len(entries) == count
    for alt in entries:
        assert alt.keys() == {"token_id", "token", "logprob"}
        assert alt["token"] == tokenizer.decode([alt["token_id"]])
    logprobs = [alt["logprob"] for alt in entries]
    assert logprobs == sorted(logprobs, reverse=True)


@pytest.mark.slow
def test_json_carries_every_sample_logprobs_token_texts_and_prompt_logprobs(server: Server, tokenizer: Any) -> None:
    doc = json.loads(jitney_generate(server, "--json", "-n", "2", "--max-tokens", "4", "--ignore-eos",
                                     "--temperature", "1", "--seed", "9", "--top-logprobs", "3",
                                     "--prompt-logprobs", "2"))
    assert list(doc) == ["request_id", "text", "token_ids", "finish_reason", "samples", "prompt_logprobs", "usage"]
    reference = unary(server, n=2, max_tokens=4, ignore_eos=True, temperature=1.0, seed=9, top_logprobs=3)
    assert [s["index"] for s in doc["samples"]] == [0, 1]
    for sample, expected in zip(doc["samples"], reference.samples):
        assert sample.keys() == {"index", "text", "token_ids", "finish_reason", "logprobs"}
        assert sample["token_ids"] == list(expected.token_ids) and sample["text"] == expected.text
        assert sample["finish_reason"] == "length"
        assert [e["token_id"] for e in sample["logprobs"]] == sample["token_ids"]
        # The unary RPC carries the same texts (top_logprobs is set).
        assert [e["token"] for e in sample["logprobs"]] == list(expected.tokens)
        for entry, logprob, top in zip(sample["logprobs"], expected.logprobs, expected.top_logprobs):
            assert entry.keys() == {"token_id", "token", "logprob", "top_logprobs"}
            assert entry["token"] == tokenizer.decode([entry["token_id"]])
            assert entry["logprob"] == pytest.approx(logprob)
            check_alternatives(entry["top_logprobs"], 3, tokenizer)
            assert [a["token_id"] for a in entry["top_logprobs"]] == list(top.token_ids)
    first = doc["samples"][0]
    assert (doc["text"], doc["token_ids"], doc["finish_reason"]) == (first["text"], first["token_ids"], "length")
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    prompt = doc["prompt_logprobs"]
    assert [p["token_id"] for p in prompt] == prompt_ids
    assert [p["token"] for p in prompt] == [tokenizer.decode([t]) for t in prompt_ids]
    assert prompt[0]["logprob"] is None and prompt[0]["top_logprobs"] == []
    for p in prompt[1:]:
        assert isinstance(p["logprob"], float)
        check_alternatives(p["top_logprobs"], 2, tokenizer)
    assert doc["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 8, "cached_prompt_tokens": 0}
    assert re.fullmatch(r"[0-9a-f]{32}", doc["request_id"])


@pytest.mark.slow
def test_json_logprobs_only_when_asked(server: Server, tokenizer: Any) -> None:
    plain = json.loads(jitney_generate(server, "--json", "--max-tokens", "3", "--ignore-eos"))
    assert list(plain) == ["request_id", "text", "token_ids", "finish_reason", "samples", "usage"]
    assert plain["samples"][0].keys() == {"index", "text", "token_ids", "finish_reason"}
    # --logprobs: the sampled tokens' logprobs and texts, no alternatives.
    doc = json.loads(jitney_generate(server, "--json", "--max-tokens", "3", "--ignore-eos", "--logprobs"))
    entries = doc["samples"][0]["logprobs"]
    assert [e.keys() for e in entries] == [{"token_id", "token", "logprob"}] * 3
    assert [e["token"] for e in entries] == [tokenizer.decode([t]) for t in plain["token_ids"]]
    assert [e["token_id"] for e in entries] == plain["token_ids"]      # greedy: the same tokens


@pytest.mark.slow
def test_n_samples_print_one_after_another(server: Server) -> None:
    out = jitney_generate(server, "-n", "2", "--max-tokens", "6", "--ignore-eos", "--temperature", "1",
                          "--seed", "5")
    reference = unary(server, n=2, max_tokens=6, ignore_eos=True, temperature=1.0, seed=5)
    expected = "".join(f"--- sample {s.index} ---\n{s.text}{'' if s.text.endswith(chr(10)) else chr(10)}"
                       f"--- end of sample {s.index} (length) ---\n" for s in reference.samples)
    assert out == expected


@pytest.mark.slow
def test_n_samples_stream_while_they_are_generated(server: Server) -> None:
    """Sample 0's text shows while the command still runs: 2 x 3000 tokens take
    this tiny model many seconds, its first characters come after a few steps."""
    proc = subprocess.Popen([sys.executable, "-m", "jitney.cli", "generate", PROMPT, "--target", server.target,
                             "-n", "2", "--max-tokens", "3000", "--ignore-eos", "--temperature", "1", "--seed", "5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    header = b"--- sample 0 ---\n"
    seen = b""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + 90
            while len(seen) < len(header) + 8 and time.monotonic() < deadline:
                if selector.select(timeout=1.0):
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        break
                    seen += chunk
            still_running = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert seen.startswith(header) and len(seen) >= len(header) + 8, seen
    assert b"--- end of sample 0" not in seen
    assert still_running, "the command ended before its first sample's text was read"


class Terminal:
    """What _SampleRelay writes, and how often it flushes."""

    def __init__(self) -> None:
        self.text = ""
        self.flushes = 0

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        self.flushes += 1


def test_the_relay_streams_the_live_sample_and_holds_the_others() -> None:
    term = Terminal()
    relay = _SampleRelay(3, term)
    relay.text(0, "a")
    relay.text(1, "B")
    relay.text(0, "b")
    assert term.text == "--- sample 0 ---\nab"          # sample 1 waits its turn
    relay.text(2, "x")
    relay.finish(2, "stop")                               # done early: held whole
    relay.text(1, "C\n")
    relay.finish(0, "length")
    assert term.text == ("--- sample 0 ---\nab\n--- end of sample 0 (length) ---\n"
                         "--- sample 1 ---\nBC\n")
    relay.text(1, "D")
    relay.finish(1, "end_of_sequence")
    assert term.text.endswith("--- sample 1 ---\nBC\nD\n--- end of sample 1 (end_of_sequence) ---\n"
                              "--- sample 2 ---\nx\n--- end of sample 2 (stop) ---\n")
    assert term.flushes > 0
