"""A whole server on a model only the transformers fallback runs (a tiny random
Starcoder2, fp32): GetModelInfo says which path serves it and that batch
invariance is not guaranteed, and greedy outputs of concurrent requests under a
tiny token budget (chunked prefill) and a KV cache too small for all of them
(preemption and recompute) equal transformers' own ``generate`` of each alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from jitney.client.client import Sampling, make_params
from jitney.v1 import generation_pb2 as pb
from tests.support.server_harness import Server, running_server
from tests.support.tiny_hf_models import generate_reference, make_tiny_hf

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = [[5, 17, 42], [300, 2, 19, 77, 140, 141, 142], list(range(30, 41)), list(range(100, 117)),
           [(7 * i) % 311 + 3 for i in range(20)], list(range(200, 223))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("sc2") / "tiny-starcoder2", "starcoder2")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model", str(model), "--dtype", "float32", "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
            "--num-blocks", "16", "--block-size", "4", "--no-weights-cache"]
    with running_server(args, tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def test_model_info_names_the_transformers_path(server: Server) -> None:
    info = server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.model_name, info.model_implementation) == ("tiny-starcoder2", "transformers")
    assert info.batch_invariant and not info.batch_invariance_guaranteed
    assert "through transformers' modeling code" in server.log()
    assert "batch-invariant kernels on (not guaranteed" in server.log()


def test_greedy_matches_transformers_under_chunking_and_preemption(server: Server, model: Path) -> None:
    stub = server.stub()

    def run(ids: list[int]) -> list[int]:
        params = make_params(ids, sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return [t for m in stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=120)
                for t in m.token_ids]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(run, PROMPTS))
    stats = server.stats()
    assert stats.preemptions > 0, "the cache was meant to be too small: no preemption happened"
    assert got == generate_reference(model, PROMPTS, MAX_TOKENS)
