"""Gemma 2 and Gemma 3 (text): Llama's parts arranged Gemma's way.

- Norms are ``x / rms(x) * (1 + w)``: the 1 is folded into the weight at load, so
  the plain RMSNorm kernels run them; a norm before and one after each sublayer
  (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``: the program's NORM and ADD_NORM).
- Embeddings scaled by sqrt(hidden) (in the model's dtype, as transformers does).
- The MLP gates with gelu (tanh approximation): GELU_MUL.
- Attention scale ``query_pre_attn_scalar^-1/2``; Gemma 2 soft-caps the scores
  (``attn_logit_softcapping``) and the final logits (``final_logit_softcapping``);
  Gemma 3 has per-head q/k norms (QK_NORM) and a rotary base of its own for the
  sliding layers (``rope_parameters["sliding_attention"]``).
- Layers interleave sliding-window attention with global attention per
  ``layer_types``: a sliding layer sees the last ``sliding_window`` keys, and its
  attention reads only those blocks (``attention/backend.py``).

The CPU's C++ layer stack runs these layers too: the sliding layers on the second
rotary table (``layer_ops``), each layer with its window and soft cap.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch

from jitney.worker.attention.backend import AttentionBackend
from jitney.worker.layers.norm import RMSNorm
from jitney.worker.layers.ops import TorchLayerOps, TritonLayerOps
from jitney.worker.layers.program import Op, Program
from jitney.worker.layers.rotary import rotary_for
from jitney.worker.models import llama
from jitney.worker.models.config import ModelConfig, UnsupportedModelError, rope_from_hf

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MODEL_TYPES = ("gemma2", "gemma3_text")

SLIDING = "sliding_attention"


def config_from_hf(hf: Any) -> ModelConfig:
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma's hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError("Gemma with bidirectional attention (an encoder) is not a decoder to serve")
    params = getattr(hf, "rope_parameters", None) or {}
    local_theta = 0.0
    if SLIDING in params:   # Gemma 3: a rotary per layer type
        local = params[SLIDING]
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"Gemma 3's sliding layers' rope type {local.get('rope_type')!r} "
                                        "is not supported (default)")
        local_theta = float(local["rope_theta"])
        theta, scaling = rope_from_hf(_GlobalRope(hf, params["full_attention"]))
    else:
        theta, scaling = rope_from_hf(hf)
    types = tuple(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    unknown = set(types) - {SLIDING, "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"Gemma layer types {sorted(unknown)} are not supported")
    cfg = llama.config_from_hf(_Silu(hf), family="gemma")
    bias = bool(getattr(hf, "attention_bias", False))
    return replace(cfg, rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                   layer_types=types, sliding_window=int(getattr(hf, "sliding_window", 0) or 0),
                   attn_logit_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
                   final_logit_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
                   attn_scale=float(hf.query_pre_attn_scalar) ** -0.5, local_rope_theta=local_theta,
                   qk_norm=hf.model_type == "gemma3_text",
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)))


class _Silu:
    """``hf`` as llama's translation reads it (the gelu is checked above)."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def __getattr__(self, name: str) -> Any:
        if name == "hidden_act":
            return "silu"
        return getattr(self._hf, name)


class _GlobalRope:
    """``hf`` with the global layers' rotary as its only one."""

    def __init__(self, hf: Any, params: dict[str, Any]) -> None:
        self._hf, self.rope_parameters, self.rope_scaling = hf, params, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


# norms: input, post_attention, pre_feedforward, post_feedforward (, q, k: Gemma 3); linears: qkv, o, gate_up, down
GEMMA2: Program = (
    (Op.INPUT_NORM, 0),
    (Op.LINEAR, 0), (Op.ROPE_CACHE, 0), (Op.ATTEND, 0), (Op.LINEAR, 1), (Op.REDUCE, 0), (Op.NORM, 1),
    (Op.ADD_NORM, 2),
    (Op.LINEAR, 2), (Op.GELU_MUL, 0), (Op.LINEAR, 3), (Op.REDUCE, 0), (Op.NORM, 3),
)
GEMMA3: Program = GEMMA2[:2] + ((Op.QK_NORM, 4),) + GEMMA2[2:]


class DecoderLayer(llama.DecoderLayer):
    PROGRAM = GEMMA2

    def add_parts(self, cfg: ModelConfig) -> None:
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gemma3 = cfg.qk_norm
        if self.gemma3:
            self.self_attn.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.self_attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.PROGRAM = GEMMA3
        if cfg.attn_scale:
            self.self_attn.scale = cfg.attn_scale
        types = cfg.layer_types or ("full_attention",) * cfg.num_layers
        self.sliding = types[self.index] == SLIDING   # (llama's layer set its window)
        if self.sliding:
            self.rope = 1   # CausalLM.local_ops
        if cfg.attn_logit_softcap:
            self.attend["softcap"] = cfg.attn_logit_softcap

    def norms(self) -> list[RMSNorm]:
        norms = [self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm]
        if self.gemma3:
            norms += [cast(RMSNorm, self.self_attn.q_norm), cast(RMSNorm, self.self_attn.k_norm)]
        return norms


class CausalLM(llama.CausalLM):
    LAYER = DecoderLayer

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, **kw: Any) -> None:
        super().__init__(cfg, backend, **kw)
        # The sliding layers' rotary (Gemma 3), else the global one.
        theta = cfg.local_rope_theta or cfg.rope_theta
        self.local_ops = TorchLayerOps(rotary_for(cfg.head_dim, theta, None if cfg.local_rope_theta else
                                                  cfg.rope_scaling))

    def use_backend(self, backend: AttentionBackend, max_positions: int) -> None:
        super().use_backend(backend, max_positions)
        rotary = self.local_ops.rotary
        self.local_ops = (TritonLayerOps(rotary, max_positions) if isinstance(self.ops, TritonLayerOps)
                          else type(self.ops)(rotary))

    def load_weights(self, tensors: Any, dtype: torch.dtype, device: torch.device) -> list[str]:
        unused = super().load_weights(tensors, dtype, device)
        with torch.no_grad():   # (1 + w): folded once, so the norm kernels are the plain ones
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
        self.local_ops = TorchLayerOps(self.local_ops.rotary.to(device))
        return unused

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        x: torch.Tensor = embed(input_ids) * torch.tensor(self.config.hidden_size ** 0.5, dtype=embed.weight.dtype)
        return x

    def layer_ops(self) -> list[TorchLayerOps]:
        """The global layers' ops, then the sliding layers' (their ``rope`` is 1)."""
        return [self.ops, self.local_ops]

    def compute_logits(self, hidden: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden, sample_indices)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

