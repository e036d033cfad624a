"""The optional features of an attention call (sliding window, soft cap,
sinks; see ``backend``'s module docstring): their checks, and the torch
path's arithmetic for the two that SDPA has not.
"""

from __future__ import annotations

import math

import torch


def check_features(num_heads: int, device: torch.device, window: int | None, softcap: float | None,
                   sinks: torch.Tensor | None) -> None:
    """Raise ``ValueError`` for a window, soft cap or sinks that no backend can honour."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32
                              or sinks.device != device):
        raise ValueError(f"sinks must be float32 of shape ({num_heads},) on {device}, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def capped_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                             softcap: float | None, sink_rows: torch.Tensor | None) -> torch.Tensor:
    """SDPA's arithmetic in float32 with a soft cap and sinks, which SDPA has not.

    q (B, kvh, M, d); k, v (B, kvh, L, d); mask (B, 1, M, L) bool, True = may
    attend; sink_rows (kvh, M): the sink of each query row. Returns (B, kvh, M, d)
    in q's dtype.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, kvh, M, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink_rows is not None:
        sink = sink_rows[None, :, :, None].expand(scores.shape[0], -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def first_window_block(seq_len: int, num_queries: int, window: int | None, block_size: int) -> int:
    """The first block a sequence's queries (its last ``num_queries`` positions) read."""
    if window is None:
        return 0
    return max(0, seq_len - num_queries - window + 1) // block_size
