"""The SwiGLU feed-forward block's weights: down(silu(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """SwiGLU feed-forward: ``gate_up_proj`` (gate, then up, stacked by rows), ``down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
