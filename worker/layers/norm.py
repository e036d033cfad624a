"""RMSNorm, computed in float32 whatever the weight dtype."""

from __future__ import annotations

import torch
from torch import nn

from jitney.worker.layers.ops import rms_norm_torch


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the weight dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)
