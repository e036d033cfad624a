"""The transformers fallback (worker/models/transformers.py): architectures with no
native family, run by transformers' own modeling code over Jitney's paged cache.

Parity: on tiny random fp32 checkpoints of four such architectures
(Starcoder2: LayerNorm, GELU, biases; GLM: partial interleaved rotary; Phi:
parallel residual, a biased head; Granite: scaled logits), greedy requests
driven through a real ``ModelRunner`` with chunked prefill (budgets of 3 and
64 tokens), preemptions with recompute, prefix-cache hits and batching give
exactly the token ids of transformers' own ``generate`` of each prompt alone,
on the CPU's batch-invariant kernels and on the torch path.

Batch invariance is not guaranteed on this path, and the Ready says so: the
linears and attention are Jitney's invariant kernels, but the norms and
activations between them are transformers' torch ops, whose float32
vector loops round a tensor's tail elements (the last < 32) differently from
the rest, so a row's bits depend on the step's size. Measured here: Starcoder2
in float32 (GELU) gives log-probs that differ from the alone run in their
last bits (5e-7), with the same tokens; GLM (SiLU) in float32 and both in
bfloat16 were bit-identical on this machine. The test below holds the
tokens equal and the log-probs within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.invariance_driver import BatchDriver, Output, Request, preempt_by_position, run_alone
from tests.support.tiny_hf_models import (FALLBACK_KINDS, generate_reference, make_tiny_hf, make_tiny_mamba,
                                          make_tiny_t5)
from tests.support.tiny_models import make_tiny_llama
from jitney.common.model_files import resolve_model
from jitney.worker.config import DType, WorkerConfig
from jitney.worker.layers.reduce import no_reduce
from jitney.worker.loading.loader import load_hf_config, load_model, model_config_from_hf
from jitney.worker.loading.weights_cache import WeightsCache
from jitney.worker.models import hf_attention, llama, registry
from jitney.worker.models import transformers as fallback
from jitney.worker.models.config import UnsupportedModelError
from jitney.worker.runner.model_runner import ModelRunner

CPU = torch.device("cpu")
MAX_TOKENS = 8
SHARED = tuple(range(100, 116))     # four whole blocks of 4: later prompts hit the prefix cache
PROMPTS: list[tuple[int, ...]] = [
    (5,),
    (300, 2, 19),
    tuple(range(30, 53)),
    SHARED + (4,),
    tuple((7 * i) % 311 + 3 for i in range(45)),
    SHARED + (9, 8, 7),
]
# Arrivals: three at once, three two steps later; preemptions at steps 4 and 9.
PREEMPT = {4: [0], 9: [1]}
WINDOWED_KINDS = ("starcoder2-window", "vaultgemma")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback")
    return {kind: make_tiny_hf(root / kind, kind) for kind in FALLBACK_KINDS}


def runner(path: Path, dtype: DType = "float32", **kwargs: Any) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), dtype=dtype, block_size=4, num_blocks=256,
                                    max_num_batched_tokens=128, max_num_seqs=16, **kwargs))


def batched(path: Path, requests: list[Request], budget: int, **kwargs: Any) -> tuple[BatchDriver, dict[int, Output]]:
    driver = BatchDriver(runner(path, **kwargs), budget=budget)
    arrivals = {0: list(enumerate(requests[:3])), 2: [(i + 3, r) for i, r in enumerate(requests[3:])]}
    return driver, driver.run(arrivals, preempt=preempt_by_position(PREEMPT))


def hf_config(kind: str, **kwargs: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, **kwargs)


# -- which path runs what -----------------------------------------------------------------

def test_unregistered_causal_lms_go_to_transformers_and_llama_stays_native(models: dict[str, Path]) -> None:
    for kind, path in models.items():
        hf = load_hf_config(resolve_model(path))
        assert registry.family_for(hf) is fallback, kind
        cfg = model_config_from_hf(hf)
        assert cfg.family == "transformers" and registry.family_named(cfg.family) is fallback
        assert (cfg.num_layers, cfg.num_kv_heads) == (2, hf.num_key_value_heads)
        rebuilt = fallback._hf_config(cfg).to_dict()                  # from the JSON it keeps
        assert rebuilt == {**hf.to_dict(), "_name_or_path": ""}
    llama_hf = hf_config("llama", architectures=["LlamaForCausalLM"])
    assert registry.family_for(llama_hf) is llama
    # Gemma 2 (windows, soft caps) is a native family, not the fallback's to refuse
    assert registry.family_for(hf_config("gemma2", architectures=["Gemma2ForCausalLM"])).__name__.endswith(".gemma")


@pytest.mark.parametrize(("kind", "kwargs", "said"), [
    ("t5", {"architectures": ["T5ForConditionalGeneration"]}, "encoder-decoder"),
    ("mamba", {"architectures": ["MambaForCausalLM"]}, "layers of type linear_attention"),
    ("jamba", {"architectures": ["JambaForCausalLM"]}, "layers of type linear_attention"),
    ("gpt2", {"architectures": ["GPT2LMHeadModel"]}, "only *ForCausalLM"),
    ("starcoder2", {"architectures": ["MyOwnForCausalLM"], "auto_map": {"AutoModelForCausalLM": "m.MyOwn"}},
     "auto_map"),
    ("falcon", {"architectures": ["FalconForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                "num_hidden_layers": 2, "vocab_size": 320}, "attention classes by name"),
])
def test_what_no_path_runs_is_refused_naming_the_architecture(kind: str, kwargs: dict[str, Any], said: str) -> None:
    hf = hf_config(kind, **kwargs)
    with pytest.raises(UnsupportedModelError, match=kwargs["architectures"][0]) as caught:
        model_config_from_hf(hf)
    assert said in str(caught.value)


def test_a_window_the_context_never_reaches_is_no_window(tmp_path: Path) -> None:
    hf = hf_config("starcoder2", architectures=["Starcoder2ForCausalLM"], sliding_window=4096,
                   max_position_embeddings=4096)
    assert registry.family_for(hf) is fallback


@pytest.mark.parametrize("make", [make_tiny_t5, make_tiny_mamba])
def test_saved_unsupported_checkpoints_are_refused_by_the_loader(tmp_path: Path, make: Any) -> None:
    with pytest.raises(UnsupportedModelError, match="is not supported"):
        load_model(str(make(tmp_path / "m")), torch.float32, CPU)


def test_layers_that_drop_the_step_are_refused_at_load(tmp_path: Path) -> None:
    # StableLm's decoder layer calls its attention without the forward's keyword arguments.
    with pytest.raises(UnsupportedModelError, match="StableLmForCausalLM.*keyword arguments"):
        load_model(str(make_tiny_hf(tmp_path / "s", "stablelm")), torch.float32, CPU)


def test_the_probe_refuses_logits_this_path_does_not_reproduce(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Starcoder2ForCausalLM

    forward = Starcoder2ForCausalLM.forward

    def rescaled(self: Any, *args: Any, **kwargs: Any) -> Any:   # a post-processing Jitney does not know
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    monkeypatch.setattr(Starcoder2ForCausalLM, "forward", rescaled)
    with pytest.raises(UnsupportedModelError, match="Starcoder2ForCausalLM: .*logits differ from transformers"):
        load_model(str(models["starcoder2"]), torch.float32, CPU)


def test_tensor_parallelism_is_refused(models: dict[str, Path]) -> None:
    cfg = model_config_from_hf(load_hf_config(resolve_model(models["glm"])))
    assert fallback.CausalLM(cfg, reduce=no_reduce).config is cfg
    with pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        fallback.CausalLM(cfg, reduce=lambda x: x)


# -- what it computes -----------------------------------------------------------------------

@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant-kernels", "torch"])
@pytest.mark.parametrize("kind", FALLBACK_KINDS)
def test_greedy_tokens_equal_transformers_generate_under_chunking_preemption_and_batching(
        models: dict[str, Path], kind: str, batch_invariant: bool) -> None:
    requests = [Request(p, MAX_TOKENS) for p in PROMPTS]
    want = generate_reference(models[kind], [list(p) for p in PROMPTS], MAX_TOKENS)
    for budget in (3, 64):
        driver, out = batched(models[kind], requests, budget, batch_invariant=batch_invariant)
        assert [out[i].tokens for i in range(len(requests))] == want, (kind, budget)
        assert any(o.preempted_after for o in out.values()) and any(o.cached_tokens for o in out.values())
        assert any(s.decodes and s.tokens > s.decodes for s in driver.steps)   # prefill chunks beside decodes


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant-kernels", "torch"])
@pytest.mark.parametrize("kind", WINDOWED_KINDS)
def test_windows_and_soft_caps_reach_the_paged_attention(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, batch_invariant: bool) -> None:
    """Starcoder2 windowed on every layer, VaultGemma on alternate layers with soft-capped
    attention logits: windows (6, 5) shorter than most prompts, so transformers' greedy ids
    are reproduced only if each layer's window and cap reach ``backend.attend``."""
    path = make_tiny_hf(tmp_path / kind, kind)
    assert registry.family_for(load_hf_config(resolve_model(path))) is fallback
    requests = [Request(p, MAX_TOKENS) for p in PROMPTS]
    want = generate_reference(path, [list(p) for p in PROMPTS], MAX_TOKENS)
    _, out = batched(path, requests, 3, batch_invariant=batch_invariant)
    assert [out[i].tokens for i in range(len(requests))] == want
    # With the features dropped, the load's probe (8 tokens, past both windows) sees it.
    monkeypatch.setattr(hf_attention, "_features", lambda *a: {})
    with pytest.raises(UnsupportedModelError, match="logits differ from transformers"):
        runner(path, batch_invariant=batch_invariant, use_weights_cache=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["starcoder2", "glm"])
def test_batched_outputs_follow_the_alone_run(models: dict[str, Path], kind: str, dtype: DType) -> None:
    """Not bit for bit (the module docstring): the same tokens, log-probs within 1e-5."""
    requests = [Request(p, MAX_TOKENS) if i % 2 == 0 else Request(p, MAX_TOKENS, temperature=0.8, top_p=0.9,
                                                                   seed=100 + i)
                for i, p in enumerate(PROMPTS)]
    alone_runner = runner(models[kind], dtype)
    alone = [run_alone(alone_runner, r) for r in requests]
    for budget in (3, 64):
        _, out = batched(models[kind], requests, budget, dtype=dtype)
        for i, ref in enumerate(alone):
            assert out[i].tokens == ref.tokens, (kind, dtype, budget, i)
            torch.testing.assert_close(out[i].logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_ready_says_transformers_and_no_guarantee(models: dict[str, Path], tmp_path: Path) -> None:
    ready = runner(models["glm"]).ready_message()
    assert (ready.model_implementation, ready.batch_invariant, ready.batch_invariance_guaranteed) == (
        "transformers", True, False)
    native = runner(make_tiny_llama(tmp_path / "llama")).ready_message()
    assert (native.model_implementation, native.batch_invariant, native.batch_invariance_guaranteed) == (
        "native", True, True)
    untied = runner(models["glm"], batch_invariant=False).ready_message()
    assert (untied.batch_invariant, untied.batch_invariance_guaranteed) == (False, False)


def test_a_restart_from_the_weights_cache_builds_the_same_model(
        models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from jitney.worker.loading import loader

    cache = WeightsCache(tmp_path / "cache")
    first, _ = load_model(str(models["phi"]), torch.float32, CPU, weights_cache=cache)

    def unread(files: Any) -> Any:
        raise AssertionError("a cache hit reads no config.json")

    monkeypatch.setattr(loader, "load_hf_config", unread)
    again, _ = load_model(str(models["phi"]), torch.float32, CPU, weights_cache=cache)
    assert again.config == first.config and again.config.family == "transformers"
    for a, b in zip(first.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(first.lm_head.bias, again.lm_head.bias)    # type: ignore[union-attr,arg-type]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_run_on_this_path(models: dict[str, Path], quantization: str) -> None:
    from jitney.worker.kernels.cpu import ops as cpu_kernels

    quantized = runner(models["starcoder2"], quantization=quantization)
    kinds = {type(m) for m in quantized.model.modules()}
    assert cpu_kernels.Int8Linear in kinds and torch.nn.Linear not in kinds
    out = run_alone(quantized, Request(PROMPTS[2], MAX_TOKENS))
    assert len(out.tokens) == MAX_TOKENS and all(0 <= t < 320 for t in out.tokens)
