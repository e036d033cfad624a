"""Grouped-query self-attention's weights: the fused q/k/v projection and the output
projection, with the head layout the layer program's ROPE_CACHE and ATTEND read
(``layers/program.py``)."""

from __future__ import annotations

import torch
from torch import nn

from jitney.worker.layers.linear import NO_SHARD, Loaded, QKVParallelLinear, RowParallelLinear, Shard, loaded_shape, whole


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache: ``qkv_proj`` (q, k, v
    stacked by rows), ``o_proj``; ``heads`` and ``scale`` for the attention itself.
    ``num_heads`` and ``num_kv_heads`` are this tensor-parallel rank's."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, shard: Shard = NO_SHARD,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias, shard=shard)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias, shard=shard)
        self.scale = scale if scale is not None else head_dim**-0.5

    @property
    def heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim


class HeadSinks(nn.Module):
    """Learned attention sinks (gpt-oss): one logit per query head that joins every
    softmax's denominator and attends to nothing, ``logits (nh,)``, this rank's heads
    (a contiguous range, as ``QKVParallelLinear`` splits the q heads)."""

    def __init__(self, num_heads: int, shard: Shard = NO_SHARD) -> None:
        super().__init__()
        self.num_heads, self.shard = num_heads, shard
        self.logits = nn.Parameter(torch.empty(num_heads))

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: object = None) -> None:
        want = (self.shard.size * self.num_heads,)
        if loaded_shape(loaded) != want:
            raise ValueError(f"weight {name}: shape {loaded_shape(loaded)}, expected {want}")
        lo = self.shard.rank * self.num_heads
        self.logits.copy_(whole(loaded)[lo:lo + self.num_heads])

    def for_attend(self) -> torch.Tensor:
        """What ``attend(sinks=)`` takes: float32 (nh,) on the parameter's device."""
        return self.logits.detach().float().contiguous()
