"""The gated feed-forward block's weights: down(act(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

from torch import nn

from jitney.worker.layers.linear import NO_SHARD, MergedColumnParallelLinear, RowParallelLinear, Shard


class MLP(nn.Module):
    """Gated feed-forward: ``gate_up_proj`` (gate, then up, stacked by rows), ``down_proj``;
    ``intermediate_size`` is this tensor-parallel rank's."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 shard: Shard = NO_SHARD) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, (intermediate_size, intermediate_size),
                                                       bias=bias, shard=shard)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, shard=shard)
