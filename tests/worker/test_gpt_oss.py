"""gpt-oss's own parts, beyond test_families' checks: YaRN's frequencies and attention
factor against transformers', MXFP4 de-quantisation against transformers' and
by hand, an MXFP4 checkpoint served as the plain weights it encodes, the experts
block (router, interleaved checkpoint layout, clamped SwiGLU) against
transformers' ``GptOssMLP``, logprobs against transformers, and GGUF refused."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.invariance_driver import Request, run_alone
from tests.support.tiny_models import make_tiny_gpt_oss, mxfp4_pack, write_mxfp4_gpt_oss
from jitney.worker.config import WorkerConfig
from jitney.worker.layers.mxfp4 import dequantize_mxfp4
from jitney.worker.layers.rotary import rotary_for
from jitney.worker.models.config import UnsupportedModelError, rope_from_hf
from jitney.worker.runner.model_runner import ModelRunner

PROMPTS = [tuple((7 * i) % 311 + 3 for i in range(45)), (300, 2, 19, 77, 140)]


def _runner(path: Path, dtype: str) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), dtype=dtype, block_size=4, num_blocks=256,  # type: ignore[arg-type]
                                    max_num_batched_tokens=128, max_num_seqs=4, use_weights_cache=False))


def _yarn_configs() -> dict[str, Any]:
    from transformers import GptOssConfig, LlamaConfig, Qwen2Config

    return {
        # the released gpt-oss's rotary (its defaults): truncate off, factor 32 over 4096
        "gpt-oss": GptOssConfig(num_hidden_layers=2, head_dim=64, num_attention_heads=4, hidden_size=256),
        # a Qwen2 long-context config: truncate on (the default), no betas given
        "qwen2": Qwen2Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=131072,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                              "original_max_position_embeddings": 32768}),
        # DeepSeek's two mscales set the attention factor
        "llama-mscale": LlamaConfig(hidden_size=192, num_attention_heads=3, max_position_embeddings=16384,
                                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 2048, "mscale": 0.707,
                                                     "mscale_all_dim": 1.0, "beta_fast": 24, "beta_slow": 2}),
        # an explicit attention factor wins
        "llama-attention-factor": LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=8192,
                                              rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                               "rope_theta": 500000.0, "attention_factor": 1.25,
                                                               "original_max_position_embeddings": 4096}),
    }


@pytest.mark.parametrize("name", ["gpt-oss", "qwen2", "llama-mscale", "llama-attention-factor"])
def test_yarn_matches_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _yarn_configs()[name]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    theta, scaling = rope_from_hf(hf)
    assert scaling is not None and scaling.rope_type == "yarn"
    rotary = rotary_for(head_dim, theta, scaling)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(rotary.inv_freq, want)
    assert math.isclose(rotary.scale, factor, rel_tol=1e-12)
    plain = rotary_for(head_dim, theta, None).inv_freq
    assert not torch.equal(want, plain) and torch.equal(want[0], plain[0])   # low dims kept, high ones slowed
    assert rotary.scale != 1.0


def test_a_qwen2_config_with_yarn_is_native() -> None:
    from jitney.worker.models.registry import family_for

    hf = _yarn_configs()["qwen2"]
    hf.architectures = ["Qwen2ForCausalLM"]
    cfg = family_for(hf).config_from_hf(hf)
    assert cfg.family == "llama" and cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    assert cfg.rope_scaling.original_max_position_embeddings == 32768 and cfg.rope_scaling.truncate


def test_mxfp4_dequantisation_matches_transformers_and_the_format() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (3, 10, 4), dtype=torch.uint8, generator=gen)   # 255 (NaN) excluded
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)   # back to (E, rows, K)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), theirs)
    # by hand: 0x2F = codes 0xF (-6, the even value) and 0x2 (1, the odd one), times 2^(130 - 127)
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x2F
    got = dequantize_mxfp4(one, torch.tensor([130], dtype=torch.uint8), torch.float32)
    assert got.shape == (32,) and got[:3].tolist() == [-48.0, 8.0, 0.0] and not got[2:].any()
    assert torch.isnan(dequantize_mxfp4(one, torch.tensor([255], dtype=torch.uint8), torch.float32)).all()
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


def test_mxfp4_pack_round_trips_within_its_precision() -> None:
    """The tests' packer: every value within 2 of its group's scale units (FP4's widest
    rounding: above 6, the largest code, up to 8), and the round trip a fixed point."""
    w = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(5))
    back = dequantize_mxfp4(*mxfp4_pack(w), torch.float32)
    step = torch.exp2(torch.floor(torch.log2(w.reshape(4, 8, 2, 32).abs().amax(-1))) - 2)   # the scale
    assert ((back - w).reshape(4, 8, 2, 32).abs() <= 2 * step[..., None] + 1e-6).all()
    assert torch.equal(dequantize_mxfp4(*mxfp4_pack(back), torch.float32), back)


@pytest.fixture(scope="module")
def round_trip_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    plain = make_tiny_gpt_oss(root / "plain", mxfp4_round_trip=True)
    return plain, write_mxfp4_gpt_oss(plain, root / "mxfp4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_mxfp4_checkpoint_serves_the_weights_it_encodes(round_trip_models: tuple[Path, Path], dtype: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from safetensors import safe_open

    plain, packed = round_trip_models
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    with caplog.at_level(logging.INFO, logger="jitney.worker"):
        runner = _runner(packed, dtype)
    assert runner.model.config.experts_format == "mxfp4"
    assert any("MXFP4" in r.getMessage() and "de-quantised" in r.getMessage() for r in caplog.records)
    reference = _runner(plain, dtype)
    assert reference.model.config.experts_format == ""
    for prompt in PROMPTS:
        want, got = run_alone(reference, Request(prompt, 6)), run_alone(runner, Request(prompt, 6))
        assert got.tokens == want.tokens and got.logprobs == want.logprobs


def test_mxfp4_blocks_without_their_scales_are_named(round_trip_models: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(round_trip_models[1], tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down"):
        _runner(tmp_path / "m", "float32")


@torch.inference_mode()
def test_fp32_logprobs_match_transformers(round_trip_models: tuple[Path, Path]) -> None:
    """Greedy tokens and their logprobs against transformers' forward over the same
    tokens: the sinks, windows, biases, router and clamps all show in the values."""
    from transformers import AutoModelForCausalLM

    plain = round_trip_models[0]
    ref = AutoModelForCausalLM.from_pretrained(str(plain), attn_implementation="eager").eval()
    runner = _runner(plain, "float32")
    for prompt in PROMPTS:
        out = run_alone(runner, Request(prompt, 8))
        ids = torch.tensor([list(prompt) + out.tokens[:-1]])
        logprobs = torch.log_softmax(ref(ids).logits[0, len(prompt) - 1:].float(), dim=-1)
        want = logprobs.gather(1, torch.tensor(out.tokens)[:, None])[:, 0]
        assert out.tokens == logprobs.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=2e-4, rtol=0)


def _hf_mlp(hidden: int, inter: int, experts: int, top_k: int, limit: float, seed: int) -> Any:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=top_k, swiglu_limit=limit, num_hidden_layers=1)
    mlp = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return mlp


@pytest.mark.parametrize("device_path", ["torch loop", "cpu kernel"])
def test_the_experts_block_matches_transformers(device_path: str) -> None:
    """Router (biased, top-k logits softmaxed), the interleaved checkpoint layout and
    the clamped SwiGLU, through ``SparseMoe`` with ``StackedExperts`` loaded by name."""
    from jitney.worker.layers.moe import SparseMoe, StackedExperts
    from jitney.worker.models.gpt_oss import rename

    mlp = _hf_mlp(32, 24, 8, 3, limit=1.0, seed=7)
    experts = StackedExperts(8, 32, 24, limit=1.0)
    moe = SparseMoe(32, 24, 8, 3, normalize=False, router_bias=True, topk_then_softmax=True, experts=experts)
    with torch.no_grad():
        for name, tensor in mlp.state_dict().items():
            renamed = rename(f"model.layers.0.mlp.{name}")
            assert renamed is not None, name
            target, part = renamed
            leaf = target.rsplit(".", 1)[1]
            module = moe.experts if ".experts." in target else moe.gate
            module.weight_loader(name, leaf, tensor, part)   # type: ignore[operator]
        if device_path == "cpu kernel":
            moe.experts.use_cpu_kernel()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(8))
    want, _ = mlp(x[None])
    ids, _ = moe.route(x)
    assert len(ids.unique()) > 3
    torch.testing.assert_close(moe.forward(x), want[0], atol=1e-5, rtol=1e-5)


def test_a_gguf_gpt_oss_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import GptOssConfig

    from jitney.worker.loading import loader

    hf = GptOssConfig(num_hidden_layers=2, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=320)
    hf.architectures = ["GptOssForCausalLM"]
    monkeypatch.setattr(loader, "load_hf_config", lambda files: hf)
    (tmp_path / "gpt-oss.gguf").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="gpt_oss from a GGUF file is not supported"):
        loader.load_model(str(tmp_path / "gpt-oss.gguf"), torch.float32, torch.device("cpu"))
