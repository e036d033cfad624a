"""The CPU's one-call layer stack (csrc/layer_stack.cpp, CausalLM.layer_stack)
against the same model run one op at a time from Python: the same kernels in
the same order, so every sampled token and every logit must be the same bits,
through chunked prefill beside decodes, a preemption with recompute and a
masked step (tests/support/runner_driver.py's scenario), for every kind of
CPU linear and for a model with q/k/v biases and a tied head."""

from __future__ import annotations

from dataclasses import replace

from typing import Any

import pytest
import torch

from tests.support.runner_driver import BLOCK, NUM_BLOCKS, scenario
from tests.support.tiny_models import make_tiny_llama, make_tiny_qwen2
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner
from jitney.worker.layers.program import Op, check_program
from jitney.worker.models import registry
from jitney.worker.models.config import ModelConfig
from jitney.worker.models.llama import DecoderLayer


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


_TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)

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
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    cpu_kernels.load()
    program = [int(op) for op, _ in DecoderLayer.PROGRAM], [index for _, index in DecoderLayer.PROGRAM]
    stack = torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25, *program)
    with pytest.raises(RuntimeError, match="no layer"):
        stack.forward(torch.zeros(1, 64), [torch.zeros(1)], [torch.zeros(1)], *[torch.zeros(1)] * 4)
    w = torch.ones(64)
    stack.add_layer(torch.zeros(1), torch.zeros(1))
    stack.add_norm(w, 1e-5)
    with pytest.raises(RuntimeError, match="need their scale"):
        stack.add_linear(1, torch.zeros(1, dtype=torch.int8), None, None, None, 64, 64, False)
    with pytest.raises(RuntimeError, match="previous layer is incomplete"):
        stack.add_layer(torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="layer 0 has 1 norms and 0 linears; its program names 2 and 4"):
        stack.check()
    with pytest.raises(RuntimeError, match="unknown linear kind"):
        stack.add_linear(7, torch.zeros(1), None, None, None, 64, 64, False)


@pytest.mark.parametrize(("ops", "indices", "message"), [
    ([1, 0], [0, 0], "starts with INPUT_NORM"),
    ([0, 10], [0, 0], "unknown layer op 10"),
    ([0, 1], [0, -1], "a negative index"),
    ([0], [0, 1], "at least one"),
])
def test_a_malformed_program_is_refused(ops: list[int], indices: list[int], message: str) -> None:
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    cpu_kernels.load()
    with pytest.raises(RuntimeError, match=message):
        torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25, ops, indices)


def test_attention_features_in_the_stack_give_the_layers_bits(models: dict[str, str]) -> None:
    """A window, a soft cap and sinks per layer (gpt-oss's sinks: no family here has them yet)
    reach the stack's attention as they reach the op-by-op backend's."""
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0])
    attends: list[dict[str, Any]] = [{"window": 3, "sinks": sinks}, {"softcap": 2.5}]
    runs = []
    for stack in (True, False):
        runner = _runner(models["llama"], "bfloat16", "none", stack=stack)
        for layer, attend in zip(runner.model.model.layers, attends, strict=True):
            layer.attend = dict(attend)
        runner.model._stack = None   # (the runner's start built one without them)
        if stack:
            assert runner.model.layer_stack(runner.cache) is not None
        runs.append(scenario(runner))
    plain = scenario(_runner(models["llama"], "bfloat16", "none", stack=True))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert torch.equal(torch.tensor(runs[0]["logits"]), torch.tensor(runs[1]["logits"]))
    assert not torch.equal(torch.tensor(runs[0]["logits"]), torch.tensor(plain["logits"]))   # the features count


def test_a_layers_rotary_table_program_and_features_are_checked() -> None:
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    cpu_kernels.load()
    program = [int(op) for op, _ in DecoderLayer.PROGRAM], [index for _, index in DecoderLayer.PROGRAM]
    stack = torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25, *program)
    assert stack.add_program([int(Op.INPUT_NORM), int(Op.NORM)], [0, 1]) == 1
    stack.add_layer(torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="no program 2"):
        stack.set_layer(2, 0, None, None, None)
    with pytest.raises(RuntimeError, match="window must be >= 1"):
        stack.set_layer(0, 0, 0, None, None)
    with pytest.raises(RuntimeError, match="softcap must be positive"):
        stack.set_layer(0, 0, None, -1.0, None)
    with pytest.raises(RuntimeError, match=r"sinks must be float32 of shape \(4\)"):
        stack.set_layer(0, 0, None, None, torch.zeros(2))
    stack.set_layer(1, 1, None, None, None)
    stack.add_norm(torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="its program names 2 and 0"):   # NORM 1 names a second norm
        stack.check()
    stack.add_norm(torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="layer 0 rotates by table 1 of 1"):
        stack.forward(torch.zeros(1, 64), [torch.zeros(1)], [torch.zeros(1)], *[torch.zeros(1)] * 4)


def test_an_experts_block_needs_its_router() -> None:
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    cpu_kernels.load()
    stack = torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25, [int(Op.INPUT_NORM), int(Op.LINEAR)], [0, 0])
    stack.add_layer(torch.zeros(1), torch.zeros(1))
    stack.add_norm(torch.ones(64), 1e-5)
    packed = torch.zeros(4, 1, 1)
    with pytest.raises(RuntimeError, match="needs its router added first"):
        stack.add_experts(packed, packed, packed, None, None, None, 64, 32, "silu", 1.0, 7.0, False, 2, True, False)
    stack.add_linear(0, torch.zeros(1), None, None, None, 64, 4, False)
    with pytest.raises(RuntimeError, match="does not score 8 experts"):
        stack.add_experts(torch.zeros(8, 1, 1), packed, packed, None, None, None, 64, 32, "silu", 1.0, 7.0, False, 2,
                          True, False)
    with pytest.raises(RuntimeError, match="top-5 of 4 experts"):
        stack.add_experts(packed, packed, packed, None, None, None, 64, 32, "silu", 1.0, 7.0, False, 5, True, False)
    stack.add_experts(packed, packed, packed, None, None, None, 64, 32, "silu", 1.0, 7.0, False, 2, True, False)
    stack.check()   # the router and its experts are the layer's one linear
    with pytest.raises(RuntimeError, match="router is a linear, not another block"):
        stack.add_experts(packed, packed, packed, None, None, None, 64, 32, "silu", 1.0, 7.0, False, 2, True, False)


def test_every_family_writes_a_well_formed_program() -> None:
    """Each registered family's layer program names only norms and linears its layer has
    (the C++ stack checks the counts again when it is built)."""
    moe = replace(_TINY, num_layers=2, num_experts=4, experts_per_token=2, moe_intermediate_size=32, dense_layers=(1,),
                  layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    for family in registry.FAMILIES:
        layer = family.CausalLM.LAYER
        for index in (0, 1):    # (a mixture-of-experts family's layer 1 is dense here)
            with torch.device("meta"):
                built = layer(moe, index=index)
            check_program(built.PROGRAM, len(built.norms()), len(built.linears()))


def test_qk_norm_names_two_norms() -> None:
    """QK_NORM i reads norms i and i + 1 (q, k): both interpreters count both."""
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    with pytest.raises(ValueError, match="QK_NORM 1: the layer has 1 of those"):
        check_program(((Op.INPUT_NORM, 0), (Op.QK_NORM, 1)), 2, 0)
    check_program(((Op.INPUT_NORM, 0), (Op.QK_NORM, 1)), 3, 0)
    cpu_kernels.load()
    stack = torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25, [int(Op.INPUT_NORM), int(Op.QK_NORM)], [0, 1])
    stack.add_layer(torch.zeros(1), torch.zeros(1))
    stack.add_norm(torch.ones(64), 1e-5)
    stack.add_norm(torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match="its program names 3 and 0"):
        stack.check()


def test_a_lora_target_must_fit_its_linear() -> None:
    """add_lora names a linear already added, A takes its inputs, B's columns lie within its outputs."""
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    cpu_kernels.load()
    stack = torch.classes.jitney_cpu.LayerStack(4, 2, 16, 0.25, [int(Op.INPUT_NORM), int(Op.LINEAR)], [0, 0])
    stack.add_layer(torch.zeros(1), torch.zeros(1))
    stack.add_norm(torch.ones(64), 1e-5)
    a, b, scale = torch.zeros(3, 8, 64), torch.zeros(3, 32, 8), torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"no linear 0 \(0 added\)"):
        stack.add_lora(0, 0, a, b, scale)
    stack.add_linear(0, torch.zeros(1), None, None, None, 64, 96, False)
    with pytest.raises(RuntimeError, match="A takes 32 features, linear 0 64"):
        stack.add_lora(0, 0, torch.zeros(3, 8, 32), b, scale)
    with pytest.raises(RuntimeError, match=r"columns \[80, 112\) are not within linear 0's 96"):
        stack.add_lora(0, 80, a, b, scale)
    with pytest.raises(RuntimeError, match=r"B \(slots, out, rank\)"):
        stack.add_lora(0, 0, a, torch.zeros(3, 32, 4), scale)
    stack.add_lora(0, 64, a, b, scale)
    stack.check()
    with pytest.raises(RuntimeError, match=r"lora_slots must be int32 of shape \(1\)"):
        stack.forward(torch.zeros(1, 64), [torch.zeros(1)], [torch.zeros(1)], *[torch.zeros(1)] * 4,
                      torch.zeros(2, dtype=torch.int32))
