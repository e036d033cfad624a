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

from tests.support.tiny_models import make_tiny_llama
from jitney.worker.config import WorkerConfig

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
    from jitney.worker.runner.model_runner import ModelRunner

    runner = ModelRunner(config)
    assert type(runner.model.backend).__name__ == "TritonPagedAttention"
    assert runner.graphs is not None
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
    assert runner.warmup_seconds > 0 and runner.ready_message().warmup_seconds == runner.warmup_seconds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_triton_match_the_cpu_torch_path(config: WorkerConfig, dtype: str) -> None:
    from tests.support.mixed_steps import generate
    from jitney.worker.runner.model_runner import ModelRunner

    cpu = generate(ModelRunner(replace(config, device="cpu", dtype="float32", attention_backend="torch")))
    gpu = generate(ModelRunner(replace(config, dtype=dtype)))
    if dtype == "float32":
        assert [ids for ids, _ in gpu] == [ids for ids, _ in cpu]
    for (_, got), (_, want) in zip(gpu, cpu):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-3 if dtype == "float32" else 0.3, rtol=0)


def test_graph_replay_equals_eager(config: WorkerConfig) -> None:
    from tests.support.mixed_steps import generate
    from jitney.worker.runner.model_runner import ModelRunner

    replayed = generate(ModelRunner(config))
    eager = ModelRunner(config, capture_graphs=False)
    assert eager.graphs is None
    assert generate(eager) == replayed
