"""Rotary embedding frequencies, with the linear, Llama 3, LongRoPE and YaRN scalings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling: ``rope_type`` "linear", "llama3" (``factor``, the two
    frequency factors), "longrope" (Phi-3: a factor per frequency, ``short_factor``
    below ``original_max_position_embeddings`` and ``long_factor`` from it on,
    cos and sin scaled by ``attention_factor``) or "yarn" (the frequencies that turn
    fewer than ``beta_slow`` times over the original context slowed by ``factor``,
    those that turn more than ``beta_fast`` times kept, a linear ramp between, whose
    ends are rounded outwards to whole dimensions when ``truncate``; cos and sin
    scaled by ``attention_factor``, its mscale)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class Rotary:
    """What the rotary inputs of a step are computed from: ``inv_freq`` (d/2,) float32,
    and with LongRoPE a second set for the positions from ``switch`` on.

    LongRoPE picks its set per token, by the token's own position: a step's cos and
    sin never depend on the rest of the batch, and a cached key keeps the rotation
    it was written with. (transformers picks one set for the whole forward, long
    once any position reaches ``original_max_position_embeddings``: the two agree
    while a sequence stays below it.)
    """

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor | None = None
    switch: int = 0
    scale: float = 1.0          # cos and sin multiplied by it (LongRoPE's attention factor)

    def to(self, device: torch.device) -> Rotary:
        long = self.long_inv_freq.to(device) if self.long_inv_freq is not None else None
        return Rotary(self.inv_freq.to(device), long, self.switch, self.scale)

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """(T, d/2) float32 angles of ``positions (T,)``."""
        pos = positions[:, None].float()
        out = pos * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            out = torch.where(positions[:, None] >= self.switch, pos * self.long_inv_freq[None, :], out)
        return out


def rotary_for(head_dim: int, theta: float, scaling: RopeScaling | None) -> Rotary:
    """The ``Rotary`` of a model's config."""
    if scaling is not None and scaling.rope_type == "longrope":
        base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
        short = 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32, device="cpu") * base)
        long = 1.0 / (torch.tensor(scaling.long_factor, dtype=torch.float32, device="cpu") * base)
        return Rotary(short, long, scaling.original_max_position_embeddings, scaling.attention_factor)
    if scaling is not None and scaling.rope_type == "yarn":
        return Rotary(yarn_inv_freq(head_dim, theta, scaling), scale=scaling.attention_factor)
    return Rotary(rope_inv_freq(head_dim, theta, scaling))


def yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies (head_dim / 2,) float32 (Peng et al. 2023, "YaRN").

    Frequency i turns ``original / wavelength_i`` times over the original context.
    Dimension pairs below the one that turns ``beta_fast`` times keep their
    frequency (extrapolation), those past the one that turns ``beta_slow`` times
    are divided by ``factor`` (interpolation), and a linear ramp blends the two between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    base = theta ** exponents
    kept, slowed = 1.0 / base, 1.0 / (scaling.factor * base)
    original = scaling.original_max_position_embeddings

    def pair_turning(turns: float) -> float:
        # the (fractional) dimension whose wavelength fits `turns` times into the original context
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001   # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp    # 1: the frequency as it was; 0: slowed by `factor`
    return slowed * (1 - keep) + kept * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, on the CPU."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type in ("longrope", "yarn"):
        raise ValueError(f"{scaling.rope_type} scales cos and sin too: rotary_for builds its Rotary")
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth
    # blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)
