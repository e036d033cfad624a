"""Weight-only int8 linears on the CPU (``--quantization int8``, ``csrc/linear_int8.cpp``).

The kernel's result is defined exactly (integer sums of int8 weights and the
activations' two int8 limbs, then one float expression), so these tests
compare it bit for bit with a torch transcription of that definition, across
row counts (batch invariance), with AMX and with the portable loops. The
row-count and fast-versus-portable tests run for int4 (``Int4Linear``) too;
int4's own tests are in ``test_cpu_int4.py``.
"""

from __future__ import annotations

import pytest
import torch

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.config import WorkerConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_float: bool) -> torch.Tensor:
    """The kernel's definition in torch: limbs, exact integer sums, the final float expression."""
    q, sw = cpu_kernels.quantize_int8(weight)
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    u = (xf * (1.0 / sx)[:, None]).clamp(-127, 127)
    h = torch.round(u)
    low = torch.round((u - h) * 254).clamp(-127, 127)
    qi = q.to(torch.int64).t()
    ah, al = h.to(torch.int64) @ qi, low.to(torch.int64) @ qi
    y = (ah.to(torch.int32).float() + al.to(torch.int32).float() * torch.tensor(1 / 254, dtype=torch.float32))
    y = y * (sx[:, None] * sw[None, :])
    if bias is not None:
        y = y + bias.float()
    return y if out_float else y.to(x.dtype)


SHAPES = [(200, 96), (70, 130), (64, 64), (5, 576), (130, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_its_definition_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int], with_bias: bool) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(37, k, generator=gen).to(dtype)
    x[3] = 0.0  # an all-zero row: scale 1, limbs 0
    for out_float in (False, True):
        lin = cpu_kernels.Int8Linear(weight, bias, out_float=out_float)
        got = lin(x)
        assert got.dtype == (torch.float32 if out_float else dtype)
        assert torch.equal(got, reference(x, weight, bias, out_float))


# The tests both weight formats share (``test_cpu_int4.py`` has int4's own).
LAYERS = {"int8": cpu_kernels.Int8Linear, "int4": cpu_kernels.Int4Linear}


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(dtype: torch.dtype, kind: str) -> None:
    """1-4 rows take int4's VNNI path, more its AMX one; int8 has one path."""
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(300, 576, generator=gen) * 0.03).to(dtype)
    lin = LAYERS[kind](weight, None)
    x = torch.randn(70, 576, generator=gen).to(dtype)
    full = lin(x)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33):
        for start in (0, 5, 70 - rows):
            assert torch.equal(lin(x[start:start + rows]), full[start:start + rows]), (rows, start)
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(lin(x), full)
            assert torch.equal(lin(x[:3]), full[:3])
        finally:
            torch.set_num_threads(old)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [2, 3, 19])
def test_fast_paths_and_portable_loops_give_the_same_bits(dtype: torch.dtype, rows: int, kind: str) -> None:
    """Also the outputs' writing: vectorised on the fast paths (150 columns: whole
    16-column groups and a ragged tail), the scalar form on the portable one.
    (2 rows: int8's 64-column units where the CPU runs 512-bit operations at full width.)"""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(150, 200, generator=gen).to(dtype)
    lin = LAYERS[kind](weight, torch.randn(150, generator=gen).to(dtype))
    x = torch.randn(rows, 200, generator=gen).to(dtype)
    x[1, 7] = float("inf")   # a row of NaN outputs
    fast = lin(x)
    assert fast[1].isnan().all() and not fast[0].isnan().any()
    lin.portable = True
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32   # NaN's bits too
    assert torch.equal(lin(x).view(bits), fast.view(bits))
    if (cpu_kernels.int8_path() if kind == "int8" else cpu_kernels.int4_path()) == "portable":
        pytest.skip(f"no fast {kind} path here: both calls ran the portable loops")


def test_error_is_the_weights_quantization() -> None:
    """Against the float product, the error stays within the int8 weights' rounding bound."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(256, 512, generator=gen) * 0.02
    x = torch.randn(16, 512, generator=gen)
    exact = x @ weight.t()
    got = cpu_kernels.Int8Linear(weight, None)(x)
    step = weight.abs().amax(dim=1) / 127  # each weight is off by at most step / 2
    bound = x.abs().sum(dim=1, keepdim=True) * step[None, :] / 2
    assert bool(((got - exact).abs() <= bound + 1e-6).all())
    rel = (got - exact).norm() / exact.norm()
    assert 0 < rel < 0.01  # typical, not worst case: ~0.3% for Gaussian weights


def test_a_non_finite_row_gives_nan_and_spares_the_others() -> None:
    weight = torch.randn(64, 64)
    lin = cpu_kernels.Int8Linear(weight, None)
    x = torch.randn(4, 64)
    clean = lin(x)
    x[1, 5] = float("inf")
    x[2, 0] = float("nan")
    got = lin(x)
    assert bool(got[1].isnan().all()) and bool(got[2].isnan().all())
    assert torch.equal(got[0], clean[0]) and torch.equal(got[3], clean[3])


def test_quantize_int8() -> None:
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-3.0, 0.001, 3.0]])
    q, scale = cpu_kernels.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [0, 0, 0] and scale[0].item() == 1.0
    assert q[1].tolist() == [64, -127, 32] and scale[1].item() == pytest.approx(2 / 127)
    assert q[2].tolist() == [-127, 0, 127]


def test_bad_input_is_refused_clearly() -> None:
    lin = cpu_kernels.Int8Linear(torch.randn(10, 32), None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        lin(torch.randn(2, 32, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="33 features, the layer takes 32"):
        lin(torch.randn(2, 33))
    with pytest.raises(RuntimeError, match="2-D"):
        lin(torch.randn(32))
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.jitney_cpu.pack_int8_weight(torch.zeros(4, 4))
    assert lin(torch.zeros(0, 32)).shape == (0, 10)


def test_config_refuses_int8_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        WorkerConfig(device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        WorkerConfig(quantization="int2")  # type: ignore[arg-type]
