"""Mixtral (``MixtralForCausalLM``): Llama's attention, and in every layer a sparse
mixture of experts in place of the MLP (``layers/moe.py``): ``num_local_experts``
experts, ``num_experts_per_tok`` per token, their weights renormalised to sum 1.

Checkpoint names: the router ``block_sparse_moe.gate``, expert e's gate / up / down
``block_sparse_moe.experts.e.w1 / w3 / w2`` (stacked into ``experts.gate_up`` and
``experts.down`` here).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torch import nn

from jitney.worker.layers.moe import SparseMoe
from jitney.worker.layers.program import Op, Program
from jitney.worker.models import llama
from jitney.worker.models.config import ModelConfig

ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)

_EXPERT = re.compile(r"^(.*\.block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_PART = {"w1": "gate", "w3": "up", "w2": "down"}


def config_from_hf(hf: Any) -> ModelConfig:
    # A sliding_window windows every layer, as transformers' Mixtral (and Mistral) apply it.
    cfg = llama.config_from_hf(hf, family="mixtral")
    return replace(cfg, num_experts=int(hf.num_local_experts), experts_per_token=int(hf.num_experts_per_tok),
                   moe_intermediate_size=int(hf.intermediate_size), norm_topk_prob=True)


def rename(name: str) -> tuple[str, object] | None:
    found = _EXPERT.match(name)
    if found is None:
        return None
    block, expert, weight = found.groups()
    return f"{block}.experts.{'down' if weight == 'w2' else 'gate_up'}", (int(expert), _PART[weight])


# norms: input_layernorm, post_attention_layernorm; linears: qkv, o, the experts block
MOE_PROGRAM: Program = (
    (Op.INPUT_NORM, 0),
    (Op.LINEAR, 0), (Op.ROPE_CACHE, 0), (Op.ATTEND, 0), (Op.LINEAR, 1), (Op.REDUCE, 0),
    (Op.ADD_NORM, 1),
    (Op.LINEAR, 2), (Op.REDUCE, 0),
)


class DecoderLayer(llama.DecoderLayer):
    PROGRAM = MOE_PROGRAM

    def add_parts(self, cfg: ModelConfig) -> None:
        del self.mlp
        self.block_sparse_moe = SparseMoe(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                          cfg.experts_per_token, normalize=cfg.norm_topk_prob, shard=self.shard)

    def linears(self) -> list[nn.Module]:
        return [self.self_attn.qkv_proj, self.self_attn.o_proj, self.block_sparse_moe]


class CausalLM(llama.CausalLM):
    LAYER = DecoderLayer

    def rename(self, name: str) -> tuple[str, object] | None:
        return rename(name)
