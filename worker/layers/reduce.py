"""The all-reduce a row-parallel layer ends with (the identity without tensor parallelism)."""

from __future__ import annotations

from collections.abc import Callable

import torch


# Sums a row-parallel layer's partial output over the tensor-parallel ranks (in place).
Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x
