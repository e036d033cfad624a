"""Jitney's paged attention as a transformers attention function.

transformers' decoders call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
in every attention module with the module, q ``(1, nh, T, d)``, k and v
``(1, kvh, T, d)`` (rotary already applied), a mask, ``scaling`` and the
keyword arguments the model's forward was given. The fallback
(``models/transformers.py``) registers ``paged_attention`` under
``ATTENTION_KEY`` and calls the decoder with the whole fused step as one row
(``input_ids (1, T)``, ``position_ids (1, T)``) and a ``PagedStep`` in the
``jitney_step`` keyword, which transformers passes down to here. Its
``attention_mask`` is None: transformers builds no mask for a function it
has no mask function for (``masking_utils._preprocess_mask_arguments``), and
the paged backend's causal mask follows the step's metadata instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata
from jitney.worker.attention.kv_cache import PagedKVCache
from jitney.worker.models.config import UnsupportedModelError

ATTENTION_KEY = "jitney_paged"


class StepNotPassed(RuntimeError):
    """The attention function ran without its ``jitney_step``: the model's layers
    do not pass the forward's keyword arguments down to attention."""


@dataclass
class PagedStep:
    """What every attention call of one forward needs: the step's metadata,
    the cache and the backend; ``attended`` collects the layers that ran
    (a model whose layers bypass the attention function is refused)."""

    meta: AttentionMetadata
    cache: PagedKVCache
    backend: AttentionBackend
    max_window: int                    # a sliding window at least this long never slides
    attended: list[int] = field(default_factory=list)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    *, jitney_step: PagedStep | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Write the step's K/V of layer ``module.layer_idx`` into the paged cache, then
    attend over it -> ``(1, T, nh, d)`` (what transformers' functions return)."""
    if jitney_step is None:
        raise StepNotPassed(f"{type(module).__name__} was called without the step's jitney_step: its layers do "
                            "not pass the forward's keyword arguments down to attention")
    _refuse_unsupported(module, kwargs, jitney_step.max_window)
    step = jitney_step
    layer = int(getattr(module, "layer_idx"))
    step.attended.append(layer)
    k_cache, v_cache = step.cache.layer(layer)
    step.backend.checking = len(step.attended) == 1     # later layers pass the same shapes
    # (T, heads, d) rows in the cache's dtype: a model may keep q/k in float32 after its rotary.
    q = query[0].transpose(0, 1).to(k_cache.dtype).contiguous()
    step.backend.write_kv(key[0].transpose(0, 1).to(k_cache.dtype).contiguous(),
                          value[0].transpose(0, 1).to(v_cache.dtype).contiguous(), k_cache, v_cache, step.meta)
    out = step.backend.attend(q, k_cache, v_cache, step.meta, scaling if scaling is not None else q.shape[-1] ** -0.5)
    return out.to(value.dtype)[None], None


def _refuse_unsupported(module: nn.Module, kwargs: dict[str, Any], max_window: int) -> None:
    """What the paged backends cannot do, should a config check have let it through."""
    if kwargs.get("softcap") is not None:
        raise UnsupportedModelError(f"{type(module).__name__}: attention logit soft-capping is not supported")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedModelError(f"{type(module).__name__}: attention sinks are not supported")
    window = kwargs.get("sliding_window")
    if window is not None and int(window) < max_window:
        raise UnsupportedModelError(f"{type(module).__name__}: sliding-window attention ({window} tokens) is "
                                    "not supported by Jitney's paged attention")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"{type(module).__name__}: non-causal attention is not supported")


def register() -> None:
    """Make ``ATTENTION_KEY`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_KEY, paged_attention)


class Rows(nn.Module):
    """A linear layer called on ``(..., in)``, run on ``(rows, in)``: Jitney's
    kernels (``kernels/cpu/ops.py``, the skinny Triton linear) take 2-D input,
    transformers' modules pass ``(1, T, in)``. The kernels' swaps
    (``replace_linears``) replace ``linear``, the ``nn.Linear`` inside."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.linear(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])

    @property
    def weight(self) -> torch.Tensor:
        """For modeling code that reads a projection's dtype or device from its weight."""
        inner = self.linear
        found = getattr(inner, "weight", None)
        if not isinstance(found, torch.Tensor):
            found = next(t for t in (*inner.parameters(), *inner.buffers()))
        return found


def wrap_linears(model: nn.Module) -> int:
    """Put every ``nn.Linear`` inside ``model`` in a ``Rows``; return how many."""
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, Rows):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Rows(child))
                wrapped += 1
    return wrapped
