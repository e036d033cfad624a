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
the paged backend's causal mask follows the step's metadata instead. The
layer's own ``sliding_window``, ``softcap`` and sinks, which transformers'
modules pass as keywords, go to ``backend.attend`` (every backend honours them).
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
    max_window: int                    # a sliding window at least this long never slides: no window
    attended: list[int] = field(default_factory=list)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    *, jitney_step: PagedStep | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Write the step's K/V of layer ``module.layer_idx`` into the paged cache, then
    attend over it -> ``(1, T, nh, d)`` (what transformers' functions return)."""
    if jitney_step is None:
        raise StepNotPassed(f"{type(module).__name__} was called without the step's jitney_step: its layers do "
                            "not pass the forward's keyword arguments down to attention")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"{type(module).__name__}: non-causal attention is not supported")
    step = jitney_step
    layer = int(getattr(module, "layer_idx"))
    step.attended.append(layer)
    k_cache, v_cache = step.cache.layer(layer)
    step.backend.checking = len(step.attended) == 1     # later layers pass the same shapes
    # (T, heads, d) rows in the cache's dtype: a model may keep q/k in float32 after its rotary.
    q = query[0].transpose(0, 1).to(k_cache.dtype).contiguous()
    step.backend.write_kv(key[0].transpose(0, 1).to(k_cache.dtype).contiguous(),
                          value[0].transpose(0, 1).to(v_cache.dtype).contiguous(), k_cache, v_cache, step.meta)
    out = step.backend.attend(q, k_cache, v_cache, step.meta, scaling if scaling is not None else q.shape[-1] ** -0.5,
                              **_features(kwargs, module, step.max_window, q.device))
    return out.to(value.dtype)[None], None


def _features(kwargs: dict[str, Any], module: nn.Module, max_window: int, device: torch.device) -> dict[str, Any]:
    """The layer's sliding window, logit soft cap and sinks as ``backend.attend`` takes them,
    from what transformers' attention modules pass: ``sliding_window`` (per module: None on
    a global layer of a model that interleaves them), ``softcap``, and gpt-oss's sinks
    (``s_aux``, one logit per query head). A window the context never fills is none."""
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    return {
        "window": int(window) if window is not None and int(window) < max_window else None,
        "softcap": float(softcap) if softcap is not None else None,
        "sinks": sinks.detach().to(device=device, dtype=torch.float32) if sinks is not None else None,
    }


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
