"""GPU-only checks: the model end to end on CUDA, graph replay vs eager.

Skipped (reason printed with ``-ra``) where torch sees no CUDA device. The
kernel-vs-reference cases of ``test_triton_kernels.py`` also run compiled on
the GPU there. Triton modules are imported inside the tests, so collecting
this file never decides interpreted-vs-compiled for the CPU tests.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.tiny_models import make_tiny_llama
from worker.config import WorkerConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> WorkerConfig:
    path = make_tiny_llama(tmp_path_factory.mktemp("cuda") / "tiny")
    return WorkerConfig(model=str(path), dtype="float32", device="cuda", block_size=16, num_blocks=64,
                        max_num_batched_tokens=64, max_num_seqs=8)


def test_auto_backend_on_cuda_is_triton_with_graphs(config: WorkerConfig) -> None:
    from worker.runner import ModelRunner

    runner = ModelRunner(config)
    assert type(runner.model.backend).__name__ == "TritonPagedAttention"
    assert runner.cuda_steps is not None and runner.cuda_steps.graphs is not None
    assert sorted(runner.cuda_steps.graphs.graphs) == [1, 2, 4, 8]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_triton_match_the_cpu_torch_path(config: WorkerConfig, dtype: str) -> None:
    from tests.test_triton_worker import generate
    from worker.runner import ModelRunner

    cpu = generate(ModelRunner(replace(config, device="cpu", dtype="float32", attention_backend="torch")))
    gpu = generate(ModelRunner(replace(config, dtype=dtype)))
    if dtype == "float32":
        assert [ids for ids, _ in gpu] == [ids for ids, _ in cpu]
    for (_, got), (_, want) in zip(gpu, cpu):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-3 if dtype == "float32" else 0.3, rtol=0)


def test_graph_replay_equals_eager(config: WorkerConfig) -> None:
    from tests.test_triton_worker import generate
    from worker.cuda_graphs import CudaSteps
    from worker.runner import ModelRunner

    replayed = generate(ModelRunner(config))
    eager = ModelRunner(config)
    assert eager.cuda_steps is not None
    eager.cuda_steps = CudaSteps(eager.model, eager.cache, graphs=None)
    assert generate(eager) == replayed


def test_sync_free_sampler_equals_sampler() -> None:
    from worker.cuda_sampling import sample_without_sync
    from worker.plan import SequenceState
    from worker.sampler import SamplingBatch, sample

    states = [SequenceState(0.0, 1.0, 0, 1), SequenceState(0.9, 1.0, 0, 2),
              SequenceState(0.7, 0.8, 0, 3), SequenceState(1.2, 1.0, 5, 4)]
    logits = torch.randn(4, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    params = SamplingBatch.from_lists(
        temperature=[s.temperature for s in states], top_p=[s.top_p for s in states],
        top_k=[s.top_k for s in states], seed=[s.seed for s in states], position=[7, 8, 9, 10],
        device=torch.device("cuda"),
    )
    got, want = sample_without_sync(logits, params, states), sample(logits, params)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
