"""Every natively served family beyond Llama, on the same checks (tiny random models
built with transformers, as the Llama tests are):

- fp32 greedy token ids equal transformers' own ``generate`` for each request, run
  alone and under continuous batching with chunked prefill, preemption and prefix hits;
- bf16 on the CPU's kernels: every batched request bit-identical to its alone run;
- the C++ layer stack gives the op-by-op layers' bits (tokens and every logit).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.invariance_driver import BatchDriver, Request, first_difference, preempt_by_position, run_alone
from tests.support.runner_driver import BLOCK, scenario
from tests.support.tiny_models import (make_tiny_gemma, make_tiny_gpt_oss, make_tiny_llama, make_tiny_mistral,
                                       make_tiny_mixtral, make_tiny_phi3, make_tiny_qwen3, make_tiny_qwen3_moe)
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (maker, the family module expected to serve it)
FAMILIES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "qwen3": (make_tiny_qwen3, "qwen3"),
    "qwen3-bias-untied": (lambda p: make_tiny_qwen3(p, attention_bias=True, tied=False, head_dim=8, seed=1), "qwen3"),
    "phi3-longrope": (make_tiny_phi3, "phi3"),     # fused qkv/gate_up tensors; every position below 64: short factors
    "mixtral": (make_tiny_mixtral, "mixtral"),
    # Qwen3's use_sliding_window: a full layer, then a windowed one (6 keys); Mixtral windowed throughout
    "qwen3-window": (lambda p: make_tiny_qwen3(p, window=6, seed=2), "qwen3"),
    "mixtral-window": (lambda p: make_tiny_mixtral(p, window=6, seed=1), "mixtral"),
    "qwen3-moe": (make_tiny_qwen3_moe, "qwen3_moe"),   # a dense layer between two sparse ones
    # windows of 6 keys (block 4) interleaved with global layers; prompts up to 45 tokens
    "gemma2": (lambda p: make_tiny_gemma(p, version=2), "gemma"),
    "gemma3": (lambda p: make_tiny_gemma(p, version=3, window=5), "gemma"),
    # windows of 6 keys and full layers, sinks, biases everywhere, 3 of 8 experts, clamped SwiGLU, YaRN
    "gpt-oss": (make_tiny_gpt_oss, "gpt_oss"),
    # head_dim 16, theta 1e4: wavelengths 6.3, 20, 63, 199, ...; against 64 / 4 and 64 / 1 one
    # frequency is kept, two are blended and five slowed by 8 (test_llama3_rope_frequencies_are_transformers)
    "llama3-rope": (lambda p: make_tiny_llama(p, rope_parameters=LLAMA3_ROPE, seed=3), "llama"),
    # every layer windowed (7 keys, block 4), prompts up to 45 tokens: served past its window
    "mistral-window": (make_tiny_mistral, "llama"),
}
PROMPTS = [(5, 17, 42), tuple(range(30, 53)), tuple((7 * i) % 311 + 3 for i in range(45)), (300, 2, 19, 77, 140),
           tuple(range(30, 45)) + (9, 9)]
TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: make(root / name) for name, (make, _) in FAMILIES.items()}


def _runner(path: Path, dtype: str, **kw: Any) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), dtype=dtype, block_size=kw.pop("block_size", 4), num_blocks=512,
                                    max_num_batched_tokens=256, max_num_seqs=16, use_weights_cache=False,
                                    **kw))  # type: ignore[arg-type]


@torch.inference_mode()
def _hf_greedy(path: Path, prompt: tuple[int, ...]) -> list[int]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    # No EOS: the driver does not stop at one, and min_new_tokens would ban it instead (another argmax)
    ref.generation_config.eos_token_id = None
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def _batched(runner: ModelRunner, requests: list[Request], budget: int) -> dict[int, Any]:
    arrivals = {0: [(0, requests[0])], 2: [(i, r) for i, r in enumerate(requests) if i]}
    return BatchDriver(runner, budget=budget).run(arrivals, preempt=preempt_by_position({4: [0], 9: [1]}))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fp32_greedy_matches_transformers_alone_and_batched(models: dict[str, Path], name: str) -> None:
    runner = _runner(models[name], "float32")
    assert runner.model.config.family == FAMILIES[name][1]
    want = [_hf_greedy(models[name], p) for p in PROMPTS]
    alone = [run_alone(runner, Request(p, TOKENS)).tokens for p in PROMPTS]
    assert alone == want
    outputs = _batched(runner, [Request(p, TOKENS) for p in PROMPTS], budget=7)
    assert [outputs[i].tokens for i in range(len(PROMPTS))] == want
    assert sum(len(o.preempted_after) for o in outputs.values()) == 2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bf16_batched_is_bit_identical_to_alone(models: dict[str, Path], name: str) -> None:
    requests = [Request(p, TOKENS, temperature=0.8 if i % 2 else 0.0, top_p=0.9 if i % 2 else 1.0, seed=i)
                for i, p in enumerate(PROMPTS * 2)]
    runner = _runner(models[name], "bfloat16")
    alone = [run_alone(runner, r) for r in requests]
    for budget in (5, 64):
        outputs = _batched(_runner(models[name], "bfloat16"), requests, budget)
        diffs = [(i, first_difference(alone[i], outputs[i])) for i in range(len(requests))]
        assert [d for d in diffs if d[1] is not None] == [], f"budget {budget}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_layer_stack_gives_the_layers_bits(models: dict[str, Path], name: str, dtype: str) -> None:
    runs = []
    for stack in (True, False):
        runner = _runner(models[name], dtype, block_size=BLOCK)
        runner.model.use_layer_stack = stack
        if stack:   # every family here: windows, soft caps, a second rotary table, experts blocks, mixed programs
            assert runner.model.STACKABLE and runner.model.layer_stack(runner.cache) is not None   # the stack runs
        runs.append(scenario(runner))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert len(runs[0]["logits"]) > 20
    assert torch.equal(torch.tensor(runs[0]["logits"]), torch.tensor(runs[1]["logits"]))


def test_longrope_takes_each_tokens_factors_by_its_own_position(models: dict[str, Path]) -> None:
    """Past the original context the long factors, before it the short ones, per token,
    with transformers' frequencies for each set and its attention factor on cos and sin."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    runner = _runner(models["phi3-longrope"], "float32")
    rotary = runner.model.ops.rotary
    hf = AutoConfig.from_pretrained(str(models["phi3-longrope"]))
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=65)
    assert torch.equal(rotary.inv_freq, short) and rotary.long_inv_freq is not None
    assert torch.equal(rotary.long_inv_freq, long) and not torch.equal(short, long)
    assert rotary.switch == 64 and abs(rotary.scale - factor) < 1e-12 and factor > 1.1
    positions = torch.tensor([0, 63, 64, 200])
    freqs = rotary.freqs(positions)
    assert torch.equal(freqs[:2], positions[:2, None].float() * short) and torch.equal(freqs[2:], positions[2:, None].float() * long)
    cos, _ = runner.model.ops.rope_inputs(positions, torch.float32)
    torch.testing.assert_close(cos[0], torch.full_like(cos[0], factor))     # cos(0) scaled


def test_llama3_rope_frequencies_are_transformers(models: dict[str, Path]) -> None:
    """Llama 3.x's frequency scaling against transformers' own, for the tiny model (all three
    bands: kept, blended, slowed) and for Llama 3.1 8B's head (128, theta 5e5, 8192)."""
    from transformers import AutoConfig, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    runner = _runner(models["llama3-rope"], "float32")
    hf = AutoConfig.from_pretrained(str(models["llama3-rope"]))
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(runner.model.ops.rotary.inv_freq, want)
    ratio = (plain / want).tolist()
    assert ratio[0] == 1.0 and all(1.0 < r < 8.0 for r in ratio[1:3]) and ratio[3:] == pytest.approx([8.0] * 5)

    from jitney.worker.layers.rotary import rope_inv_freq
    from jitney.worker.models.config import rope_from_hf

    big = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    theta, scaling = rope_from_hf(big)
    assert torch.equal(rope_inv_freq(128, theta, scaling), ROPE_INIT_FUNCTIONS["llama3"](big, "cpu")[0])


def test_the_experts_torch_loop_matches_the_cpu_kernel() -> None:
    """The experts' torch path (CUDA's until a fused kernel lands) against the CPU kernel,
    float32: top-k order in both, so within rounding."""
    from jitney.worker.layers.moe import SparseMoe

    gen = torch.Generator().manual_seed(11)
    moe = SparseMoe(32, 24, 8, 3, normalize=False)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(8, 32, generator=gen))
        moe.experts.gate_up.copy_(torch.randn(8, 48, 32, generator=gen) * 0.2)
        moe.experts.down.copy_(torch.randn(8, 32, 24, generator=gen) * 0.2)
    x = torch.randn(40, 32, generator=gen)
    ids, weights = moe.route(x)
    assert ids.shape == (40, 3) and len(ids.unique()) > 3
    loop = moe.forward(x)
    moe.experts.use_cpu_kernel()
    torch.testing.assert_close(moe.forward(x), loop, atol=1e-5, rtol=1e-5)
