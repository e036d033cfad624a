"""GGUF files of the native families transformers' GGUF reader knows (Qwen3, Qwen3-MoE,
Gemma 2, Gemma 3, Phi-3), written from tiny HF models (``tests/support/tiny_gguf.py``):
its ModelConfig is the HF folder's, and Jitney serves it with the HF model's fp32 greedy
tokens, all prompts in one batch.

The tiny models use what a GGUF file can state: no LongRoPE factors (Phi-3), every
layer sparse and the top-k renormalised (Qwen3-MoE: llama.cpp's default), Gemma's
layer pattern and ``query_pre_attn_scalar`` at transformers' defaults (a GGUF states
neither). What the file states but transformers' reader drops (Qwen3's head_dim,
the experts' width, Gemma 2's soft-caps, Gemma 3's sliding rotary base) is set by
Jitney's loader, so the HF original is the reference, not transformers' GGUF load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.invariance_driver import BatchDriver, Request
from tests.support.tiny_gguf import quantised, write_gguf
from tests.support.tiny_models import make_tiny_gemma, make_tiny_phi3, make_tiny_qwen3, make_tiny_qwen3_moe
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner

S, F = "sliding_attention", "full_attention"
# name -> (maker of the HF folder, the family module expected to serve its GGUF)
FAMILIES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "qwen3": (make_tiny_qwen3, "qwen3"),     # head_dim 24, not hidden / heads = 16
    "qwen3-moe": (lambda p: make_tiny_qwen3_moe(p, mlp_only_layers=(), norm_topk_prob=True), "qwen3_moe"),
    "gemma2": (lambda p: make_tiny_gemma(p, version=2, layer_types=(S, F, S, F), query_pre_attn_scalar=256), "gemma"),
    "gemma3": (lambda p: make_tiny_gemma(p, version=3, window=5, layer_types=(S,) * 5 + (F,),
                                         query_pre_attn_scalar=256), "gemma"),
    "phi3": (lambda p: make_tiny_phi3(p, longrope=False), "phi3"),
}
PROMPTS = [(5, 17, 42), tuple(range(30, 53)), tuple((7 * i) % 311 + 3 for i in range(45)), (300, 2, 19, 77, 140)]
TOKENS = 6


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), dtype="float32", block_size=4, num_blocks=256,
                                    max_num_batched_tokens=256, max_num_seqs=8, use_weights_cache=False))


def _jitney_greedy(path: Path) -> tuple[str, list[list[int]]]:
    runner = _runner(path)
    outputs = BatchDriver(runner, budget=256).run({0: [(i, Request(p, TOKENS)) for i, p in enumerate(PROMPTS)]})
    return runner.model.config.family, [outputs[i].tokens for i in range(len(PROMPTS))]


@torch.inference_mode()
def _hf_greedy(model: Any) -> list[list[int]]:
    model.generation_config.eos_token_id = None   # the driver does not stop at EOS
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
        out.append([int(t) for t in ids[0, len(prompt):]])
    return out


def _hf_model(folder: Path, gguf_file: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_model_config_is_the_hf_folders(tmp_path: Path, name: str) -> None:
    # Greedy tokens alone miss some of it: a final soft-cap never moves the argmax, and
    # the tiny models' scores sit far below Gemma 2's default cap of 50.
    from jitney.common.model_files import resolve_model
    from jitney.worker.loading.loader import load_hf_config, model_config_from_hf

    folder = FAMILIES[name][0](tmp_path / name)
    want, got = (asdict(model_config_from_hf(load_hf_config(resolve_model(p))))
                 for p in (folder, write_gguf(folder, tmp_path / f"{name}.F32.gguf")))
    # GGUF stores the epsilon as a float32
    assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)
    assert got == want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_greedy_matches_the_hf_original(tmp_path: Path, name: str) -> None:
    make, family = FAMILIES[name]
    folder = make(tmp_path / name)
    gguf = write_gguf(folder, tmp_path / f"{name}.F32.gguf")
    served, tokens = _jitney_greedy(gguf)
    assert served == family
    assert tokens == _hf_greedy(_hf_model(folder))


def test_f16_gguf_matches_transformers_load_of_the_same_file(tmp_path: Path) -> None:
    # F16 weights are not the original's: the reference is transformers' model of this file.
    folder = make_tiny_phi3(tmp_path / "phi3", longrope=False)
    gguf = write_gguf(folder, tmp_path / "phi3.F16.gguf", dtype="F16")
    _, tokens = _jitney_greedy(gguf)
    assert tokens == _hf_greedy(_hf_model(tmp_path, gguf.name))


def test_q8_0_gguf_matches_the_hf_original_on_its_rounded_weights(tmp_path: Path) -> None:
    # transformers cannot load this file itself (its config keeps the experts at its default
    # width), so the reference is the HF original with each weight the file quantised put
    # through Q8_0 and back: the stacked experts de-quantised and split as in the file.
    import gguf

    folder = make_tiny_qwen3_moe(tmp_path / "moe", mlp_only_layers=(), norm_topk_prob=True)
    path = write_gguf(folder, tmp_path / "moe.Q8_0.gguf", dtype="Q8_0")
    _, tokens = _jitney_greedy(path)
    model = _hf_model(folder)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if quantised(name, param):
                rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8), q8)
                param.copy_(torch.from_numpy(rounded.reshape(param.shape)))
    assert tokens == _hf_greedy(model)


def test_a_phi3_gguf_with_longrope_factors_is_refused(tmp_path: Path) -> None:
    from jitney.common.model_files import resolve_model
    from jitney.worker.loading.loader import load_hf_config
    from jitney.worker.models.config import UnsupportedModelError

    folder = make_tiny_phi3(tmp_path / "phi3")   # LongRoPE
    path = write_gguf(folder, tmp_path / "phi3.F32.gguf")
    with pytest.raises(UnsupportedModelError, match="LongRoPE factors"):
        load_hf_config(resolve_model(path))
