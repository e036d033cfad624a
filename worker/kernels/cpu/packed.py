"""Pre-packed oneDNN linear layers for bf16 on the CPU.

``F.linear`` on bf16 CPU tensors re-lays the weight out on every call; a
weight packed once for oneDNN (``mkldnn._reorder_linear_weight``) runs the
same product 1.4-1.5x faster at the batch sizes of decoding (1-64 rows;
equal at 512), with bit-identical results in our measurements (see
docs/journal/2026-11-26-first-cpu-figures.md). fp32 is left alone: there packing is slower at one row
and does not round the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``pack_linears`` applies to a model in ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_packs_bf16()


@functools.cache
def _onednn_packs_bf16() -> bool:
    """Whether this CPU's oneDNN packs bf16 weights: it refuses to on a CPU with
    neither AVX-512 (BW, VL, DQ) nor AVX-NE-CONVERT, e.g. an AVX2-only one, where the
    plain ``F.linear`` runs instead."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W pre-packed for oneDNN; x is (T, in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by ``make(linear)``; return how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
                replaced += 1
    return replaced


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a ``PackedLinear``; return how many."""
    return replace_linears(model, lambda linear: PackedLinear(linear.weight, linear.bias))
