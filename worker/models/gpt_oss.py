"""gpt-oss (``GptOssForCausalLM``): Llama's pre-norm layers with

- attention: biases on q, k, v and o; a learned sink logit per head
  (``self_attn.sinks``, ``layers/attention.py``'s ``HeadSinks``) in every softmax's
  denominator; layers alternating per ``layer_types`` between a sliding window of
  ``sliding_window`` keys and full attention; YaRN rotary (``layers/rotary.py``);
- in every layer a sparse mixture of experts (``layers/moe.py``): a router with a
  bias whose top ``num_experts_per_tok`` logits are softmaxed among themselves, and
  ``num_local_experts`` experts with biases and a clamped SwiGLU
  (``swiglu_alpha``, ``swiglu_limit``).

Checkpoint names: ``mlp.router.weight / bias`` (this file's ``mlp.gate``), the
experts as whole stacked tensors ``mlp.experts.gate_up_proj`` (gate and up
interleaved), ``down_proj`` and their ``_bias``, or, in the released MXFP4
checkpoints (``quantization_config.quant_method`` "mxfp4"), ``_blocks`` and
``_scales`` in place of the two weights: de-quantised to the serving dtype at load
(no MXFP4 kernel yet; ``layers/mxfp4.py``). A GGUF gpt-oss is refused (see
``READS_GGUF``).

They run op by op or in the C++ layer stack (its experts block takes gpt-oss's
routing: the top k of the logits, then their softmax).
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from jitney.worker.layers.attention import HeadSinks
from jitney.worker.layers.moe import SparseMoe, StackedExperts
from jitney.worker.models import llama
from jitney.worker.models.config import ModelConfig, UnsupportedModelError
from jitney.worker.models.mixtral import MOE_PROGRAM

logger = logging.getLogger("jitney.worker")

ARCHITECTURES = ("GptOssForCausalLM",)
MODEL_TYPES = ("gpt_oss",)
SLIDING = "sliding_attention"
# transformers' GGUF reader renames gpt-oss's experts to per-expert Mixtral names that
# neither its own model nor this one loads: refused by name rather than half-loaded.
READS_GGUF = False

_ROUTER = re.compile(r"^(.*\.mlp)\.router\.(weight|bias)$")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj(_bias|_blocks|_scales)?$")
_SINKS = re.compile(r"^(.*\.self_attn)\.sinks$")


def config_from_hf(hf: Any) -> ModelConfig:
    quant = getattr(hf, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method not in (None, "mxfp4"):
        raise UnsupportedModelError(f"gpt-oss quantised with {method!r} is not supported (plain or mxfp4)")
    types = tuple(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    unknown = set(types) - {SLIDING, "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"gpt-oss layer types {sorted(unknown)} are not supported")
    cfg = llama.config_from_hf(hf, family="gpt_oss")
    bias = bool(getattr(hf, "attention_bias", True))
    return replace(cfg, qkv_bias=bias, o_bias=bias, layer_types=types,
                   sliding_window=int(getattr(hf, "sliding_window", 0) or 0),
                   num_experts=int(hf.num_local_experts), experts_per_token=int(hf.num_experts_per_tok),
                   moe_intermediate_size=int(hf.intermediate_size),
                   swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                   swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
                   experts_format="mxfp4" if method == "mxfp4" else "")


def rename(name: str) -> tuple[str, object] | None:
    if (found := _ROUTER.match(name)) is not None:
        return f"{found[1]}.gate.{found[2]}", None
    if (found := _EXPERTS.match(name)) is not None:
        block, weight, suffix = found.groups()
        if suffix == "_bias":
            return f"{block}.{weight}_bias", "plain"
        return f"{block}.{weight}", (suffix or "_plain")[1:]
    if (found := _SINKS.match(name)) is not None:
        return f"{found[1]}.sink.logits", None
    return None


class DecoderLayer(llama.DecoderLayer):
    PROGRAM = MOE_PROGRAM   # norms: input, post_attention; linears: qkv, o, the experts block

    def add_parts(self, cfg: ModelConfig) -> None:
        del self.mlp
        experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, self.shard,
                                 mxfp4=cfg.experts_format == "mxfp4", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        self.mlp = cast(Any, SparseMoe(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                       cfg.experts_per_token, normalize=False, shard=self.shard, router_bias=True,
                                       topk_then_softmax=True, experts=experts))
        self.self_attn.sink = HeadSinks(cfg.num_heads, self.shard)   # (llama's layer set its window)

    def linears(self) -> list[nn.Module]:
        return [self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp]


class CausalLM(llama.CausalLM):
    LAYER = DecoderLayer

    def rename(self, name: str) -> tuple[str, object] | None:
        return rename(name)

    def load_weights(self, tensors: Any, dtype: torch.dtype, device: torch.device) -> list[str]:
        if self.config.experts_format == "mxfp4":
            name = str(dtype).removeprefix("torch.")
            logger.info("gpt-oss experts are MXFP4 in the checkpoint: de-quantised to %s at load "
                        "(no MXFP4 kernel yet: the experts take %s's memory)", name, name)
        unused = super().load_weights(tensors, dtype, device)
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            layer.attend["sinks"] = cast(HeadSinks, layer.self_attn.sink).for_attend()
        return unused
