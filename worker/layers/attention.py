"""Grouped-query self-attention's weights: the fused q/k/v projection and the output
projection, with the head layout the layer program's ROPE_CACHE and ATTEND read
(``layers/program.py``)."""

from __future__ import annotations

from torch import nn


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache: ``qkv_proj`` (q, k, v
    stacked by rows), ``o_proj``; ``heads`` and ``scale`` for the attention itself."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden_size, bias=o_bias)
        self.scale = head_dim**-0.5

    @property
    def heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim
