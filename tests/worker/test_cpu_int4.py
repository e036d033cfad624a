"""4-bit weights on the CPU (``--quantization int4``, ``csrc/linear_int4.cpp``).

An int4 layer is defined as the int8 layer of the integer weights ``c * q``
(``q`` in [-8, 7], one ``c`` in [1, 16] per 32 inputs of a column) with the
same per-column scales; the kernel reads them from half a byte each. So
these tests compare it bit for bit with ``linear_int8`` on those int8
weights (itself tested against its definition in ``test_cpu_int8.py``), on
every path: AVX-512 VNNI (up to 4 rows), AMX (more) and the portable loops.
That rows do not depend on their batch, and that the fast paths and the
portable loops give the same bits, is tested with int8's, in
``test_cpu_int8.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.config import WorkerConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHAPES = [(200, 96), (70, 130), (64, 64), (5, 576), (130, 1), (96, 1536)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 37]  # 1-4: the VNNI path where there is one; more: AMX


def int8_twin(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 layout's packed ``c * q`` and the scales that an int4 layer of ``weight`` stands for."""
    cpu_kernels.load()
    q, c, scale = cpu_kernels.quantize_int4(weight)
    k = weight.shape[1]
    wide = q.to(torch.int32) * c.to(torch.int32).repeat_interleave(cpu_kernels.INT4_GROUP, dim=1)[:, :k]
    return torch.ops.jitney_cpu.pack_int8_weight(wide.to(torch.int8)), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_int8_on_the_weights_it_stands_for(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed, scale = int8_twin(weight)
    lin = cpu_kernels.Int4Linear(weight, bias)
    assert torch.equal(torch.ops.jitney_cpu.unpack_int4_weight(lin.q4, lin.cv, k, n), packed)
    assert lin.q4.numel() == packed.numel() // 2   # half a byte a weight
    x = torch.randn(max(ROWS), k, generator=gen).to(dtype)
    x[2] = 0.0  # an all-zero row
    for rows in ROWS:
        for out_float in (False, True):
            lin.out_float = out_float
            got = lin(x[:rows])
            want = torch.ops.jitney_cpu.linear_int8(x[:rows], packed, scale, bias, k, n, out_float, False)
            assert got.dtype == want.dtype and torch.equal(got, want), (rows, out_float)


def test_fast_paths_are_used_where_the_cpu_has_them() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    if " amx_int8" in flags and " avx512vbmi" in flags and " avx512_vnni" in flags:
        assert cpu_kernels.int4_path() == "amx"
        assert cpu_kernels.int8_path() == "amx"
    elif " avx512_vnni" in flags and " avx512bw" in flags:
        assert cpu_kernels.int4_path() in ("amx", "vnni")
        assert cpu_kernels.int8_path() in ("amx", "vnni")
    else:
        pytest.skip("this CPU has neither AMX-INT8 nor AVX-512 VNNI")


def test_quantize_int4() -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 100, generator=gen) * 0.02
    w[5] = 0.0
    w[6, 40:] = 0.0       # a column whose later groups are all zero
    w[7, :32] *= 30       # one loud group
    q, c, scale = cpu_kernels.quantize_int4(w)
    assert q.shape == (64, 100) and q.dtype == torch.int8 and c.shape == (64, 4) and c.dtype == torch.uint8
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(c.min()) >= 1 and int(c.max()) <= 16
    assert scale[5].item() == 1.0 and not q[5].any()
    step = scale[:, None] * c.float().repeat_interleave(32, dim=1)[:, :100]
    deq = q.float() * step
    err = (deq - w).abs()
    inside = (q > -8) & (q < 7)   # rounded, not clamped: within half a step; clamped at 7: within one
    assert bool((err[inside] <= step[inside] * 0.5 + 1e-7).all()) and bool((err <= step + 1e-7).all())
    assert int(c[7, 0]) >= 14 and int(c[7, 1:].max()) <= 2   # the loud group takes a top step, the quiet ones fine ones
    assert c[6, 2:].tolist() == [1, 1]                          # all-zero groups: any c, the smallest
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0 < rel < 0.12   # ~9% for Gaussian weights: 4 bits


def test_error_against_the_float_product() -> None:
    gen = torch.Generator().manual_seed(12)
    weight = torch.randn(256, 512, generator=gen) * 0.02
    x = torch.randn(16, 512, generator=gen)
    exact = x @ weight.t()
    rel = ((cpu_kernels.Int4Linear(weight, None)(x) - exact).norm() / exact.norm()).item()
    assert 0.01 < rel < 0.12   # the 4-bit weights' error, about 10x int8's


def test_bad_input_is_refused_clearly() -> None:
    lin = cpu_kernels.Int4Linear(torch.randn(10, 32), None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        lin(torch.randn(2, 32, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="33 features, the layer takes 32"):
        lin(torch.randn(2, 33))
    assert lin(torch.zeros(0, 32)).shape == (0, 10)
    q = torch.zeros(4, 40, dtype=torch.int8)
    c = torch.ones(4, 2, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"\[-8, 7\]"):
        torch.ops.jitney_cpu.pack_int4_weight(q + 8, c)
    with pytest.raises(RuntimeError, match=r"\[1, 16\]"):
        torch.ops.jitney_cpu.pack_int4_weight(q, c * 0)
    with pytest.raises(RuntimeError, match="one scale per 32 inputs"):
        torch.ops.jitney_cpu.pack_int4_weight(q, torch.ones(4, 1, dtype=torch.uint8))
    q4, cv = torch.ops.jitney_cpu.pack_int4_weight(q, c)
    with pytest.raises(RuntimeError, match="does not match the layer's shape"):
        torch.ops.jitney_cpu.linear_int4(torch.randn(1, 40), q4, cv, torch.ones(70), None, 40, 70, False, False)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.jitney_cpu.linear_int4(torch.randn(1, 40), q4, cv, torch.ones(3), None, 40, 4, False, False)


def test_config_takes_int4_on_the_cpu_only() -> None:
    assert WorkerConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="CPU only"):
        WorkerConfig(device="cuda", quantization="int4")
