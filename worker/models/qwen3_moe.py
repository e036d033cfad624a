"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k norms) and a
sparse mixture of experts (``layers/moe.py``) in place of the MLP in every layer
but ``mlp_only_layers`` and those off ``decoder_sparse_step``'s beat (a dense MLP
of ``intermediate_size`` there); ``num_experts_per_tok`` of ``num_experts`` per
token, renormalised when ``norm_topk_prob``.

Checkpoint names: the router ``mlp.gate``, expert e's ``mlp.experts.e.gate_proj /
up_proj / down_proj`` (stacked into ``mlp.experts.gate_up`` and ``.down`` here).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, cast

from torch import nn

from jitney.worker.layers.moe import SparseMoe
from jitney.worker.layers.program import Op, Program
from jitney.worker.models import qwen3
from jitney.worker.models.config import ModelConfig

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def config_from_hf(hf: Any) -> ModelConfig:
    cfg = replace(qwen3.config_from_hf(hf), family="qwen3_moe")
    experts, step = int(hf.num_experts), int(getattr(hf, "decoder_sparse_step", 1) or 1)
    only = set(getattr(hf, "mlp_only_layers", None) or [])
    dense = tuple(i for i in range(cfg.num_layers) if i in only or experts == 0 or (i + 1) % step)
    return replace(cfg, num_experts=experts, experts_per_token=int(hf.num_experts_per_tok),
                   moe_intermediate_size=int(hf.moe_intermediate_size),
                   norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)), dense_layers=dense)


def rename(name: str) -> tuple[str, object] | None:
    found = _EXPERT.match(name)
    if found is None:
        return None
    block, expert, proj = found.groups()
    return f"{block}.experts.{'down' if proj == 'down_proj' else 'gate_up'}", (int(expert), proj[: -len("_proj")])


# norms: input_layernorm, post_attention_layernorm, q_norm, k_norm; linears: qkv, o, the experts block
MOE_PROGRAM: Program = (
    (Op.INPUT_NORM, 0),
    (Op.LINEAR, 0), (Op.QK_NORM, 2), (Op.ROPE_CACHE, 0), (Op.ATTEND, 0), (Op.LINEAR, 1), (Op.REDUCE, 0),
    (Op.ADD_NORM, 1),
    (Op.LINEAR, 2), (Op.REDUCE, 0),
)


class DecoderLayer(qwen3.DecoderLayer):
    """A sparse layer runs ``MOE_PROGRAM``, a dense one Qwen3's."""

    def add_parts(self, cfg: ModelConfig) -> None:
        super().add_parts(cfg)
        if self.index not in cfg.dense_layers:
            del self.mlp
            self.mlp = cast(Any, SparseMoe)(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.experts_per_token,
                                 normalize=cfg.norm_topk_prob, shard=self.shard)
            self.PROGRAM = MOE_PROGRAM

    def linears(self) -> list[nn.Module]:
        if isinstance(self.mlp, SparseMoe):
            return [self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp]
        return super().linears()


class CausalLM(qwen3.CausalLM):
    LAYER = DecoderLayer

    def rename(self, name: str) -> tuple[str, object] | None:
        return rename(name)
