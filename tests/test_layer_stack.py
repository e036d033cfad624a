"""The CPU's one-call layer stack (csrc/cpu_stack.cpp, CausalLM.layer_stack)
against the same model run one op at a time from Python: the same kernels in
the same order, so every sampled token and every logit must be the same bits,
through chunked prefill beside decodes, a preemption with recompute and a
masked step (tests/test_tensor_parallel.py's scenario), for every kind of
CPU linear and for a model with q/k/v biases and a tied head."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.tiny_models import make_tiny_llama, make_tiny_qwen2
from jitney.worker.config import WorkerConfig
from jitney.worker.runner import ModelRunner
from tests.test_runner import BLOCK, NUM_BLOCKS
from tests.test_tensor_parallel import scenario


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stack")
    return {"llama": str(make_tiny_llama(root / "llama")), "qwen2": str(make_tiny_qwen2(root / "qwen2")),
            # an intermediate size of 128: bf16's gate_up and SiLU in one pass (linear_silu_mul)
            "llama-mlp128": str(make_tiny_llama(root / "llama-mlp128", intermediate_size=128, seed=2))}


def _runner(model: str, dtype: str, quantization: str, *, stack: bool) -> ModelRunner:
    runner = ModelRunner(WorkerConfig(model=model, dtype=dtype, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                      max_num_batched_tokens=64, max_num_seqs=8, use_weights_cache=False,
                                      quantization=quantization))  # type: ignore[arg-type]
    runner.model.use_layer_stack = stack
    return runner


KINDS = (("bfloat16", "none"), ("float32", "none"), ("bfloat16", "int8"), ("bfloat16", "int4"))


@pytest.mark.parametrize(("model", "dtype", "quantization"), [
    *((model, dtype, quantization) for model in ("llama", "qwen2") for dtype, quantization in KINDS),
    ("llama-mlp128", "bfloat16", "none"),
])
def test_the_stack_gives_the_layers_bits(models: dict[str, str], model: str, dtype: str, quantization: str) -> None:
    with_stack = _runner(models[model], dtype, quantization, stack=True)
    assert with_stack.model.layer_stack(with_stack.cache) is not None    # the stack is what runs
    without = _runner(models[model], dtype, quantization, stack=False)
    got: dict[str, Any] = scenario(with_stack)
    want: dict[str, Any] = scenario(without)
    assert got["tokens"] == want["tokens"]
    assert got["refused"] and want["refused"]
    assert len(got["logits"]) == len(want["logits"]) > 20
    assert torch.equal(torch.tensor(got["logits"]), torch.tensor(want["logits"]))


def test_the_stack_applies_only_to_the_cpu_kernels_path(models: dict[str, str]) -> None:
    """Without the batch-invariant kernels (oneDNN linears, torch attention) the
    layers run one op at a time; a stack is made once per cache."""
    plain = ModelRunner(WorkerConfig(model=models["llama"], dtype="bfloat16", block_size=BLOCK,
                                     num_blocks=NUM_BLOCKS, max_num_batched_tokens=64, max_num_seqs=8,
                                     use_weights_cache=False, batch_invariant=False))
    assert plain.model.layer_stack(plain.cache) is None
    runner = _runner(models["llama"], "bfloat16", "none", stack=True)
    stack = runner.model.layer_stack(runner.cache)
    assert stack is not None and stack.num_layers() == len(runner.model.model.layers)
    assert runner.model.layer_stack(runner.cache) is stack


def test_an_incomplete_stack_is_refused() -> None:
    from jitney.worker import cpu_kernels

    cpu_kernels.load()
    stack = torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="incomplete"):
        stack.forward(torch.zeros(1, 64), *[torch.zeros(1)] * 6)
    w = torch.ones(64)
    stack.add_layer(w, 1e-5, w, 1e-5, torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="need their scale"):
        stack.add_linear(1, torch.zeros(1, dtype=torch.int8), None, None, None, 64, 64, False)
    with pytest.raises(RuntimeError, match="of its 4 linears"):
        stack.add_layer(w, 1e-5, w, 1e-5, torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="unknown linear kind"):
        stack.add_linear(7, torch.zeros(1), None, None, None, 64, 64, False)

