"""MXFP4 weights (the OCP Microscaling format, as gpt-oss checkpoints store their
experts), de-quantised: Jitney has no MXFP4 kernel yet, so a checkpoint's MXFP4
tensors become the serving dtype at load (the same values; bf16 takes about 3.8
times the memory of the packed form's 4.25 bits a value).

A row of K values is stored as ``blocks (..., K / 32, 16)`` uint8 and ``scales
(..., K / 32)`` uint8: each group of 32 values shares one E8M0 scale (the power of
two ``2^(s - 127)``), and each byte holds two FP4 E2M1 codes, the lower nibble the
group's even value, the upper the odd one. A code is a sign bit and 3 bits indexing
(0, 0.5, 1, 1.5, 2, 3, 4, 6). Every such value times a power of two is exact in
float32 and bfloat16 (their 8 exponent bits cover E8M0's range), so the result
does not depend on the dtype it is made in.
"""

from __future__ import annotations

import torch

# FP4 E2M1 code -> value: codes 0-7 positive, 8-15 the same magnitudes negated.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32          # values per scale
SCALE_BIAS = 127    # E8M0: 2^(byte - 127); 255 is NaN


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks (..., G, 16)`` and ``scales (..., G)``, both uint8 -> ``(..., G * 32)`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks (..., G, {GROUP // 2}) need scales (..., G): got blocks "
                         f"{tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()     # (..., G, 16, 2): even, odd
    values = table[codes].flatten(-2)                                     # (..., G, 32)
    exponent = scales.to(torch.int32) - SCALE_BIAS
    power = torch.ldexp(torch.ones(exponent.shape, device=blocks.device), exponent)
    power = power.masked_fill(scales == 255, float("nan"))
    return (values * power[..., None]).flatten(-2).to(dtype)
