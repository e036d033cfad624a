"""What every model family is described by: its shape and numerics (``ModelConfig``),
its rotary scaling, and the facts the scheduler needs (``ModelFacts``)."""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from jitney.worker.layers.rotary import RopeScaling


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder (the native families' in full; the transformers
    fallback's cache geometry, with its Hugging Face config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    family: str = "llama"  # the models/ file that runs it (models/registry.py)
    # The transformers fallback (family "transformers"): the Hugging Face config as JSON,
    # from which it builds transformers' model; "" for the native families.
    hf_config: str = ""
    # A mixture of experts (``layers/moe.py``): E experts of ``moe_intermediate_size``,
    # ``experts_per_token`` of them per token; ``dense_layers`` keep a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # gpt-oss's experts: the clamped SwiGLU's alpha and limit, and the checkpoint's
    # format of their weights ("mxfp4": de-quantised at load; "": the serving dtype's).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    experts_format: str = ""
    # Per-layer attention (Gemma): each layer's type ("full_attention" or
    # "sliding_attention", which sees the last ``sliding_window`` keys), the scores'
    # and the final logits' soft caps (0: none), the attention scale (0: head_dim^-0.5),
    # and the sliding layers' own rotary base.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    attn_scale: float = 0.0
    local_rope_theta: float = 0.0
    qk_norm: bool = False    # per-head q/k norms (Gemma 3; Qwen3's family always has them)


@dataclass(frozen=True)
class ModelFacts:
    """What the scheduler needs to know about the model (sent in Ready)."""

    name: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]


class UnsupportedModelError(ValueError):
    """The model is not one this worker can run."""


def rope_from_hf(hf: Any) -> tuple[float, RopeScaling | None]:
    """The rotary base and scaling of a transformers config."""
    # transformers 5 keeps everything in rope_parameters; 4.x used
    # rope_theta plus an optional rope_scaling dict.
    params = {**(getattr(hf, "rope_scaling", None) or {}), **(getattr(hf, "rope_parameters", None) or {})}
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if rope_type == "longrope":
        return theta, _longrope(hf, params)
    if rope_type == "yarn":
        return theta, _yarn(hf, params)
    raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, linear, llama3, longrope, yarn)")


def _longrope(hf: Any, params: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE, with transformers' defaults: ``factor`` from the two context
    lengths, and the attention factor sqrt(1 + ln(factor) / ln(original)) unless given."""
    original = int(params.get("original_max_position_embeddings")
                   or getattr(hf, "original_max_position_embeddings", None) or hf.max_position_embeddings)
    factor = float(params.get("factor") or hf.max_position_embeddings / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(f) for f in params["short_factor"]),
                       long_factor=tuple(float(f) for f in params["long_factor"]), attention_factor=float(attention))


def _yarn(hf: Any, params: dict[str, Any]) -> RopeScaling:
    """YaRN with transformers' defaults: the original context from the config's own
    ``original_max_position_embeddings`` first (as transformers standardises it), then
    the rope parameters', then the context; ``factor`` from the two contexts when
    absent; betas 32 and 1; ``truncate`` on; the attention factor
    (mscale) ``0.1 ln(factor) + 1``, or DeepSeek's ratio of two mscales, unless given."""
    original = int(getattr(hf, "original_max_position_embeddings", None)
                   or params.get("original_max_position_embeddings") or hf.max_position_embeddings)
    factor = float(params.get("factor") or hf.max_position_embeddings / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)))
