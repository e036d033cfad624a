"""Greedy output through the whole server equals transformers' own generate.

The default model (SmolLM2-135M-Instruct), fp32. The server runs with a tiny
token budget (prompts are chunked over several steps) and a KV cache too small
for all requests at once (requests are preempted and recomputed); each
request must still produce exactly what `generate` gives it alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from jitney.v1 import generation_pb2 as pb
from jitney.client.client import Sampling, make_params
from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
from bench.quant_accuracy import prompt_ids as parity_prompt_ids
from tests.support.reference_model import default_model_reference
from tests.support.server_harness import ROOT, running_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def reference_outputs(prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    model = default_model_reference(tmp_path_factory)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    args = ["--dtype", "float32", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
            "--num-blocks", "14", "--block-size", "16"]
    with running_server(args, tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def test_greedy_matches_transformers_under_chunking_and_preemption(server,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    prompt_ids = parity_prompt_ids(load_tokenizer(resolve_model(None), cache_root()))
    stub = server.stub()

    def run(ids: list[int]) -> list[int]:
        params = make_params(ids, sampling=Sampling(max_tokens=MAX_TOKENS))
        msgs = stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=300)
        return [t for m in msgs for t in m.token_ids]

    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        got = list(pool.map(run, prompt_ids))
    stats = server.stats()
    assert stats.preemptions > 0, "the cache was meant to be too small: no preemption happened"
    assert stats.kv_blocks_used == 0
    assert got == reference_outputs(prompt_ids, tmp_path_factory)


def test_generate_command_answers_the_capital_of_france(server) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jitney.cli", "generate", "--target", server.target, "--chat", "--json",
         "What is the capital of France?"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    result = json.loads(out)
    assert result["text"] == "The capital of France is Paris."
    assert result["finish_reason"] == "end_of_sequence"
    assert result["usage"]["completion_tokens"] == len(result["token_ids"])
    streamed = subprocess.run(
        [sys.executable, "-m", "jitney.cli", "generate", "--target", server.target, "--chat",
         "What is the capital of France?"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    assert streamed.strip() == "The capital of France is Paris."
