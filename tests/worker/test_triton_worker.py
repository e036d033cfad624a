"""The worker with the Triton backend (interpreted on CPU) vs the torch backend.

Also the CUDA step's padding and sync-free sampling, with the graphs
emulated (``DecodeGraphs(capture=False)`` runs the padded forward eagerly
over the staging buffer), and the backend choice.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.triton_support import interpret_without_cuda

interpret_without_cuda()

from jitney.engine.v1 import engine_pb2 as pb  # noqa: E402
from tests.support.tiny_models import make_tiny_llama  # noqa: E402
from tests.support.mixed_steps import PROMPTS, generate  # noqa: E402
from jitney.worker.attention.backends import BackendUnavailableError, resolve_backend_name  # noqa: E402
from jitney.worker.config import WorkerConfig  # noqa: E402
from jitney.worker.runner.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from jitney.worker.runner.model_runner import ModelRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> WorkerConfig:
    path = make_tiny_llama(tmp_path_factory.mktemp("triton") / "tiny")
    return WorkerConfig(model=str(path), dtype="float32", device=DEVICE, block_size=4, num_blocks=64,
                        max_num_batched_tokens=64, max_num_seqs=8, attention_backend="torch")


def assert_same_run(got: list, want: list) -> None:
    for (ids, logprobs), (want_ids, want_logprobs) in zip(got, want, strict=True):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def torch_run(config: WorkerConfig) -> list:
    return generate(ModelRunner(config))


def test_triton_backend_matches_torch_backend(config: WorkerConfig, torch_run: list) -> None:
    runner = ModelRunner(replace(config, attention_backend="triton"))
    assert type(runner.model.backend).__name__ == "TritonPagedAttention"
    assert_same_run(generate(runner), torch_run)


def test_cuda_step_padding_and_sync_free_sampling(config: WorkerConfig, torch_run: list) -> None:
    """Decode steps of 3 sequences padded to the captured size 4 (graphs emulated on CPU)."""
    runner = ModelRunner(replace(config, attention_backend="triton"))
    graphs = DecodeGraphs(runner.model, runner.cache, runner.batch, [1, 4], capture=DEVICE == "cuda")
    runner.graphs = graphs
    padded = []
    logits = graphs.logits
    graphs.logits = lambda size: padded.append(size) or logits(size)  # type: ignore[method-assign]
    assert_same_run(generate(runner), torch_run)
    assert padded == [4, 4, 4]  # the decode-only steps (3 sequences) took the graph path, padded to 4


def test_all_greedy_decode_steps_take_the_graphs_own_choice(config: WorkerConfig) -> None:
    """With every row greedy, the decode graph's in-graph argmax and logprob are the result."""
    greedy = {sid: pb.SamplingConfig() for sid in PROMPTS}
    want = generate(ModelRunner(config), sampling=greedy)
    runner = ModelRunner(replace(config, attention_backend="triton"))
    runner.graphs = DecodeGraphs(runner.model, runner.cache, runner.batch, [1, 4], capture=DEVICE == "cuda")
    sampled_eagerly = []
    sample_rows = runner._sample
    runner._sample = lambda step, logits: sampled_eagerly.append(step) or sample_rows(step, logits)  # type: ignore[method-assign]
    assert_same_run(generate(runner, sampling=greedy), want)
    assert len(sampled_eagerly) == 3  # the three steps with prefill chunks; the decode-only ones used the graph


def test_mixed_steps_padded_to_a_token_bucket(config: WorkerConfig, torch_run: list) -> None:
    """Prefill and mixed steps through the tile-mapped mixed graphs (emulated on CPU): padding
    rows and tokens change nothing."""
    runner = ModelRunner(replace(config, attention_backend="triton"))
    graphs = DecodeGraphs(runner.model, runner.cache, runner.batch, [1, 4], capture=DEVICE == "cuda",
                          mixed_tokens=[16, 32])
    runner.graphs = graphs
    buckets = []
    hidden = graphs.mixed_hidden
    graphs.mixed_hidden = lambda tokens: buckets.append(tokens) or hidden(tokens)  # type: ignore[method-assign]
    assert_same_run(generate(runner), torch_run)
    assert buckets == [16, 16, 32]  # 14, 10 and 25 tokens


def test_capture_sizes() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend_name("auto", cpu) == "torch"
    assert resolve_backend_name("auto", cuda) == "triton"
    assert resolve_backend_name("torch", cuda) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", cpu)
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerConfig(attention_backend="flash")  # type: ignore[arg-type]


def test_attention_backend_flag() -> None:
    import argparse

    from jitney.worker.config import add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert WorkerConfig.from_namespace(parser.parse_args([])).attention_backend == "auto"
    assert WorkerConfig.from_namespace(parser.parse_args(["--attention-backend", "triton"])).attention_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])



def test_skinny_linears_match_the_torch_backend(config: WorkerConfig, torch_run: list) -> None:
    """With a skinny config for every weight shape (as a card's tuned file gives), steps of up to
    16 tokens run the skinny linears, eagerly and from the (emulated) decode graphs, and give the
    torch backend's tokens and logprobs; larger steps run F.linear."""
    from jitney.worker.kernels.triton import skinny as triton_skinny

    skinny = replace(config, attention_backend="triton", batch_invariant=False, skinny_rows=16)
    shapes = {tuple(m.weight.shape) for m in ModelRunner(skinny, capture_graphs=False).model.modules()
              if isinstance(m, torch.nn.Linear)}
    try:
        triton_skinny.CONFIGS.update({shape: triton_skinny.SkinnyConfig(16, 32, 4, 2) for shape in shapes})
        for graphs in (False, True):
            runner = ModelRunner(skinny, capture_graphs=False)
            swapped = [m for m in runner.model.modules() if isinstance(m, triton_skinny.SkinnyLinear)]
            assert len(swapped) >= 4 * runner.model.config.num_layers and all(m.max_rows == 16 for m in swapped)
            assert not any(isinstance(m, torch.nn.Linear) for m in runner.model.modules())   # the head too
            if graphs:
                runner.graphs = DecodeGraphs(runner.model, runner.cache, runner.batch, [1, 4],
                                             capture=DEVICE == "cuda")
            rows = []
            kernel = triton_skinny.skinny_linear
            triton_skinny.skinny_linear = lambda *a, **k: rows.append(a[0].shape[0]) or kernel(*a, **k)  # type: ignore[assignment]
            try:
                assert_same_run(generate(runner), torch_run)
            finally:
                triton_skinny.skinny_linear = kernel  # type: ignore[assignment]
            # step 0: 11 + 3 prompt tokens; step 1: a decode and 2 tokens; later: decodes (3; 4 in a graph,
            # emulated on the CPU; a captured graph's replays make no Python call to count)
            assert 14 in rows and 3 in rows
            if graphs:
                assert (4 in rows) == (DEVICE != "cuda")
            assert 25 not in rows   # the 23-token prompt's step ran F.linear
    finally:
        triton_skinny.CONFIGS.clear()


def test_skinny_rows_default_and_refusals() -> None:
    from jitney.worker.runner.device import SKINNY_ROWS, skinny_rows

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert skinny_rows(WorkerConfig(), cuda, graph_safe=True, batch_invariant=False) == SKINNY_ROWS
    assert skinny_rows(WorkerConfig(), cuda, graph_safe=True, batch_invariant=True) == 0
    assert skinny_rows(WorkerConfig(), cpu, graph_safe=True, batch_invariant=False) == 0
    assert skinny_rows(WorkerConfig(skinny_rows=8), cpu, graph_safe=True, batch_invariant=False) == 8
    assert skinny_rows(WorkerConfig(skinny_rows=0), cuda, graph_safe=True, batch_invariant=False) == 0
    with pytest.raises(ValueError, match="--skinny-rows needs"):
        skinny_rows(WorkerConfig(skinny_rows=8), cuda, graph_safe=True, batch_invariant=True)
    with pytest.raises(ValueError, match="--skinny-rows needs"):
        skinny_rows(WorkerConfig(skinny_rows=8), cpu, graph_safe=False, batch_invariant=False)
    with pytest.raises(ValueError, match="skinny_rows must be"):
        WorkerConfig(skinny_rows=65)
