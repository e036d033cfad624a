"""Qwen3 (dense): the Llama family's layer with an RMSNorm on each q and k head before rotary.

Its config names ``head_dim`` explicitly (Qwen3-0.6B: 16 heads of 128 over a
hidden size of 1024), and ``attention_bias`` puts a bias on q, k, v and o alike.
The per-head norms are ``self_attn.q_norm`` and ``self_attn.k_norm`` (weights of
``head_dim``, replicated on every tensor-parallel rank: a rank's heads are whole).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from jitney.worker.layers.norm import RMSNorm
from jitney.worker.layers.program import Op, Program
from jitney.worker.models import llama
from jitney.worker.models.config import ModelConfig

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


def config_from_hf(hf: Any) -> ModelConfig:
    # With use_sliding_window, transformers' config names the windowed layers in
    # layer_types (from max_window_layers on); llama's _layer_windows applies them.
    cfg = llama.config_from_hf(hf, family="qwen3")
    bias = bool(getattr(hf, "attention_bias", False))
    return replace(cfg, qkv_bias=bias, o_bias=bias)


class DecoderLayer(llama.DecoderLayer):
    """Llama's layer with QK_NORM between the q/k/v projection and rotary."""

    # norms: input_layernorm, post_attention_layernorm, q_norm, k_norm; linears: qkv, o, gate_up, down
    PROGRAM: Program = (
        (Op.INPUT_NORM, 0),
        (Op.LINEAR, 0), (Op.QK_NORM, 2), (Op.ROPE_CACHE, 0), (Op.ATTEND, 0), (Op.LINEAR, 1), (Op.REDUCE, 0),
        (Op.ADD_NORM, 1),
        (Op.LINEAR, 2), (Op.SILU_MUL, 0), (Op.LINEAR, 3), (Op.REDUCE, 0),
    )

    def add_parts(self, cfg: ModelConfig) -> None:
        self.self_attn.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norms(self) -> list[RMSNorm]:
        attn = self.self_attn
        return [self.input_layernorm, self.post_attention_layernorm, cast(RMSNorm, attn.q_norm),
                cast(RMSNorm, attn.k_norm)]


class CausalLM(llama.CausalLM):
    LAYER = DecoderLayer
