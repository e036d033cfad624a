"""The decoder layer's elementwise work, one implementation per path.

The model calls four operations between its matmuls:

    add_rms_norm   residual += x, then x = RMSNorm(residual)      (before attention and MLP)
    rope_and_cache rotary on q and k, k and v into the paged cache (after the q/k/v matmul)
    silu_mul       silu(gate) * up                                  (between the MLP's matmuls)
    rms_norm       the first layer's input norm

and, in a step with LoRA adapters, ``lora_add`` after each targeted linear
(``layers/lora.py``): torch's per-row sums, or ``csrc/lora.cpp`` on the CPU's path.

``TorchLayerOps`` is plain torch with the reference models' rounding (the
CPU's ``--no-batch-invariant`` path, and the reference for the others).
``InvariantCpuLayerOps`` (the CPU default) and ``TritonLayerOps`` (with the
Triton attention backend) run each as one kernel (``csrc/elementwise.cpp``,
``triton_fused.py``), so a decode layer is 9 calls: norm, qkv, rope+cache,
attention, o_proj, norm, gate_up, silu_mul, down.
Its argument checks run for the first layer of a step only (``checking``);
the other layers get the same shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata
from jitney.worker.layers.lora import lora_delta
from jitney.worker.layers.rotary import Rotary


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back before the weight, as the reference models do."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (T, heads, d)`` by position, in the half-split layout of HF."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class TorchLayerOps:
    """Plain torch: the CPU path (and the reference for the fused kernels)."""

    checking = True

    def __init__(self, rotary: Rotary | torch.Tensor) -> None:
        # (a tensor: plain inverse frequencies, (d/2,) float32)
        self.rotary = rotary if isinstance(rotary, Rotary) else Rotary(rotary)

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Per-step rotary inputs: cos, sin (T, d) in ``dtype``, computed once for all layers."""
        freqs = self.rotary.freqs(positions)  # (T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
        cos, sin = emb.cos(), emb.sin()
        if self.rotary.scale != 1.0:
            cos, sin = cos * self.rotary.scale, sin * self.rotary.scale
        return cos.to(dtype), sin.to(dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_torch(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return rms_norm_torch(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu (tanh approximation) of the gate times up: elementwise torch on every path."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 slots: torch.Tensor, offset: int) -> None:
        """In place: ``y``'s columns from ``offset`` gain each row's adapter delta
        (``layers/lora.py``'s ``lora_delta``), rounded once into y's dtype."""
        part = y[:, offset: offset + b.shape[1]]
        part.copy_((part.float() + lora_delta(x, a, b, scale, slots)).to(y.dtype))

    def rope_and_cache(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, torch.Tensor],
                       meta: AttentionMetadata, backend: AttentionBackend,
                       heads: tuple[int, int, int]) -> torch.Tensor:
        """Rotated q ``(T, nh, d)``; rotated k and v written to the cache."""
        nh, kvh, d = heads
        t = qkv.shape[0]
        q, k, v = qkv.split((nh * d, kvh * d, kvh * d), dim=-1)
        cos, sin = rope
        q = apply_rotary(q.view(t, nh, d), cos, sin)
        k = apply_rotary(k.view(t, kvh, d), cos, sin)
        backend.write_kv(k, v.view(t, kvh, d), kv[0], kv[1], meta)
        return q


class InvariantCpuLayerOps(TorchLayerOps):
    """The CPU's batch-invariant path: one C++ call per operation.

    ``csrc/elementwise.cpp`` (norms, rotary + cache write) and
    ``cpu_kernels.silu_mul``, so a decode layer is 9 calls like Triton's:
    norm, qkv, rope+cache, attention, o_proj, add+norm, gate_up, silu_mul,
    down. Each row's arithmetic depends on that row only (the norm's mean
    of squares is a fixed-order sum), with the torch reference's rounding
    points: the rotary and the residual add give its bits, the norm is within
    rounding of it (the order of its float32 sum differs from torch's).
    ``add_rms_norm`` works in place, like Triton's: ``x`` becomes the norm,
    ``residual`` the sum. torch's float32 SiLU rounds a vector's tail
    differently from its body, hence the SiLU kernel; Gemma's gelu_mul is
    one kernel too. LoRA's add is ``cpu_kernels.lora_add`` (the layer stack's too).
    ``rope_inputs`` stays torch's (cos, sin once per step for all layers).
    """

    def __init__(self, rotary: Rotary | torch.Tensor) -> None:
        super().__init__(rotary)
        cpu_kernels.load()
        ops = torch.ops.jitney_cpu
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.add_rms_norm.default
        self._rope_and_cache = ops.rope_and_cache.default
        self._silu_mul = ops.silu_mul.default
        self._gelu_mul = ops.gelu_mul.default
        self._lora_add = ops.lora_add.default

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor = self._rms_norm(x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._add_rms_norm(x, residual, weight, eps)  # both in place
        return x, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._silu_mul(gate_up)
        return out

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``cpu_kernels``' gelu_mul: torch's roundings in one pass (two ATen calls took ~3x)."""
        out: torch.Tensor = self._gelu_mul(gate_up)
        return out

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 slots: torch.Tensor, offset: int) -> None:
        """``csrc/lora.cpp``: rows grouped by adapter, each row's sums in a fixed order (batch-invariant)."""
        self._lora_add(y, x, a, b, scale, slots, offset, False)

    def rope_and_cache(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, torch.Tensor],
                       meta: AttentionMetadata, backend: AttentionBackend,
                       heads: tuple[int, int, int]) -> torch.Tensor:
        """Rotated q ``(T, nh, d)``; rotated k and v stored at ``meta.slot_mapping``
        (as ``TorchPagedAttention.write_kv`` stores them; a negative slot stores nothing)."""
        nh, kvh, d = heads
        cos, sin = rope
        q: torch.Tensor = self._rope_and_cache(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, nh, kvh, d)
        return q


class TritonLayerOps(TorchLayerOps):
    """One fused Triton kernel per operation (CUDA, or the interpreter in tests)."""

    def __init__(self, rotary: Rotary | torch.Tensor, max_positions: int) -> None:
        super().__init__(rotary)
        from jitney.worker.kernels.triton import fused as triton_fused
        from jitney.worker.kernels.triton import lora as triton_lora

        self.kernels = triton_fused
        self.lora_kernels = triton_lora
        # (a step's slots tensor, its rows grouped by slot): made once a step, read by every linear
        self._lora_blocks: tuple[torch.Tensor, triton_lora.LoraBlocks] | None = None
        freqs = self.rotary.freqs(torch.arange(max_positions, device=self.rotary.inv_freq.device))
        scale = self.rotary.scale
        self.cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).contiguous()  # (max_positions, d)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return (positions,)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps, check=self.checking)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.fused_add_rms_norm(x, residual, weight, eps, check=self.checking)  # both in place
        return x, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up, check=self.checking)

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 slots: torch.Tensor, offset: int) -> None:
        """``kernels/triton/lora.py``: the step's rows grouped by slot on the device (no read back),
        shrink and expand per block of one adapter's rows, added into y's columns rounded once."""
        cached = self._lora_blocks
        if cached is None or cached[0] is not slots:
            cached = self._lora_blocks = (slots, self.lora_kernels.lora_blocks(slots, a.shape[0]))
        self.lora_kernels.lora_add_triton(y, offset, x, a, b, scale, slots, cached[1], check=self.checking)

    def rope_and_cache(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, torch.Tensor],
                       meta: AttentionMetadata, backend: AttentionBackend,
                       heads: tuple[int, int, int]) -> torch.Tensor:
        nh, kvh, d = heads
        (positions,) = rope
        self.kernels.rope_write_kv(qkv, positions, self.cos_sin, kv[0], kv[1], meta.slot_mapping, nh, kvh, d,
                                   check=self.checking)
        return qkv[:, : nh * d].view(qkv.shape[0], nh, d)  # q, rotated in place
