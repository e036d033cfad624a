"""Megatron-style tensor parallelism of a model: what one rank's model is.

Rank ``r`` of ``N`` builds its model from ``local_config`` (its contiguous
range of q and KV heads, its share of the MLP's intermediate size) and its
``Shard``; each linear layer then loads its own part of every checkpoint
tensor (``layers/linear.py``: column-parallel q/k/v and gate/up, row-parallel
o and down, a row-parallel bias added once). A layer's attention and MLP run on
local heads and a local slice of the intermediate size, and one all-reduce
after o_proj and one after down_proj sum the partial outputs. Contiguous head
ranges keep GQA's grouping: q head ``h`` reads KV head ``h // (nh / kvh)``, and
both ranges start at multiples of the group.

The embedding and the head are replicated, not vocabulary-parallel: the
logits need no collective and rank 0 samples from its own (the head is a
small share of a Llama's weights; a 128k vocabulary would change that).
"""

from __future__ import annotations

from dataclasses import replace

from jitney.worker.layers.linear import Shard
from jitney.worker.models.config import ModelConfig

__all__ = ["Shard", "check_shardable", "local_config"]


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming what does not split ``size`` ways."""
    bad = [f"{what} ({value})" for what, value in (("attention heads", cfg.num_heads),
                                                    ("KV heads", cfg.num_kv_heads),
                                                    ("MLP intermediate size", cfg.intermediate_size),
                                                    ("experts' intermediate size", cfg.moe_intermediate_size))
           if value % size]
    if bad:
        raise ValueError(f"tensor parallelism over {size} ranks needs the model's {', '.join(bad)} "
                         f"to be divisible by {size}")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's model has: its heads and its share of the MLP."""
    check_shardable(cfg, size)
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                   intermediate_size=cfg.intermediate_size // size,
                   moe_intermediate_size=cfg.moe_intermediate_size // size)
