"""The skinny linear kernel (``worker/triton_skinny.py``) against torch references.

Without CUDA it runs under the Triton interpreter on CPU tensors; with CUDA
the same cases run compiled. The references follow the unfused path's
rounding: ``F.linear`` (float32 accumulation, rounded once after the
bias), RMSNorm rounded twice, SiLU·mul rounded once, the residual add
rounded once. Only the order of the sums differs, so results agree to
the dtype's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker import triton_skinny  # noqa: E402
from jitney.worker.triton_skinny import MAX_ROWS, SkinnyConfig, skinny_config, skinny_linear  # noqa: E402

skip_unless_interpreted(triton)
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2)}
EPS = 1e-5


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    if b is not None:
        out = out + b.float()
    return out.to(w.dtype)


def ref_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return (weight.float() * y.float()).to(x.dtype)


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


def dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE, copy=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 17])
def test_plain_product_with_and_without_bias(dtype: torch.dtype, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    n, k = 40, 72   # neither a multiple of the blocks: masked columns and K tail
    x, w, b = rand(g, m, k, dtype=dtype), rand(g, n, k, dtype=dtype, scale=0.1), rand(g, n, dtype=dtype)
    close(skinny_linear(dev(x), dev(w)), ref_linear(x, w, None))
    close(skinny_linear(dev(x), dev(w), dev(b)), ref_linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_prologue_is_rms_norm_then_product(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    m, n, k = 5, 48, 96
    x = rand(g, m, k, dtype=dtype, scale=3.0)
    w, nw = rand(g, n, k, dtype=dtype, scale=0.1), rand(g, k, dtype=dtype)
    got = skinny_linear(dev(x), dev(w), prologue="norm", norm_weight=dev(nw), eps=EPS)
    close(got, ref_linear(ref_norm(x, nw), w, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_prologue_and_residual_add(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    m, n, k = 4, 32, 80
    gate_up = rand(g, m, 2 * k, dtype=dtype)
    w, b = rand(g, n, k, dtype=dtype, scale=0.1), rand(g, n, dtype=dtype)
    residual = rand(g, m, n, dtype=dtype)
    out = dev(residual)
    got = skinny_linear(dev(gate_up), dev(w), dev(b), prologue="silu_mul", out=out, add=True)
    assert got is out   # in place
    product = ref_linear(ref_silu_mul(gate_up), w, b)
    close(got, (product.float() + residual.float()).to(dtype))


def test_rows_past_m_and_other_rows_untouched() -> None:
    """A residual add writes only its M rows' N columns: a view into a wider buffer keeps the rest."""
    g = torch.Generator().manual_seed(3)
    x, w = rand(g, 3, 24, dtype=torch.float32), rand(g, 20, 24, dtype=torch.float32)
    buffer = dev(torch.full((5, 30), 7.0))
    skinny_linear(dev(x), dev(w), out=buffer[:3, :20], add=True)
    host = buffer.cpu()
    close(host[:3, :20], ref_linear(x, w, None) + 7.0)
    assert (host[3:] == 7.0).all() and (host[:, 20:] == 7.0).all()


def test_a_row_does_not_depend_on_its_neighbours_within_a_launch() -> None:
    """Row i of a 9-row launch equals the 1-row launch of row i: one block of rows, one order of sums."""
    g = torch.Generator().manual_seed(4)
    x, w = rand(g, 9, 64, dtype=torch.bfloat16), rand(g, 32, 64, dtype=torch.bfloat16, scale=0.1)
    nw = rand(g, 64, dtype=torch.bfloat16)
    batch = skinny_linear(dev(x), dev(w), prologue="norm", norm_weight=dev(nw), eps=EPS).cpu()
    for i in (0, 4, 8):
        alone = skinny_linear(dev(x[i:i + 1]), dev(w), prologue="norm", norm_weight=dev(nw), eps=EPS).cpu()
        assert torch.equal(alone[0], batch[i])


def test_configured_launch_shapes_give_the_same_product() -> None:
    g = torch.Generator().manual_seed(5)
    x, w = rand(g, 2, 100, dtype=torch.float32), rand(g, 50, 100, dtype=torch.float32)
    want = ref_linear(x, w, None)
    try:
        for cfg in (SkinnyConfig(16, 32, 4, 2), SkinnyConfig(32, 64, 4, 3), SkinnyConfig(64, 128, 8, 4)):
            triton_skinny.CONFIGS[(50, 100)] = cfg
            assert skinny_config(50, 100) == cfg
            close(skinny_linear(dev(x), dev(w)), want)
    finally:
        triton_skinny.CONFIGS.pop((50, 100), None)


@pytest.mark.parametrize("case, message", [
    ("rows", "at most"),
    ("width", "x must be \\(M, 16\\)"),
    ("silu_width", "x must be \\(M, 32\\)"),
    ("dtype", "x is torch.float16"),
    ("norm_missing", "norm_weight is needed"),
    ("norm_extra", "norm_weight is needed"),
    ("add_without_out", "out is needed"),
    ("out_shape", "out must be"),
    ("out_is_x", "must not be x"),
    ("prologue", "prologue must be"),
    ("bias", "bias must be"),
])
def test_bad_arguments_are_refused(case: str, message: str) -> None:
    w = torch.zeros(8, 16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    kwargs: dict = {}
    if case == "rows":
        x = torch.zeros(MAX_ROWS + 1, 16, device=DEVICE)
    elif case == "width":
        x = torch.zeros(2, 12, device=DEVICE)
    elif case == "silu_width":
        kwargs["prologue"] = "silu_mul"
    elif case == "dtype":
        x = x.half()
    elif case == "norm_missing":
        kwargs["prologue"] = "norm"
    elif case == "norm_extra":
        kwargs["norm_weight"] = torch.ones(16, device=DEVICE)
    elif case == "add_without_out":
        kwargs["add"] = True
    elif case == "out_shape":
        kwargs["out"] = torch.zeros(2, 9, device=DEVICE)
    elif case == "out_is_x":
        x = torch.zeros(2, 16, device=DEVICE)
        w = torch.zeros(16, 16, device=DEVICE)
        kwargs.update(out=x, add=True)
    elif case == "prologue":
        kwargs["prologue"] = "gelu"
    elif case == "bias":
        kwargs["bias"] = torch.zeros(7, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        skinny_linear(x, w, **kwargs)


def test_compiles_for_ampere_and_hopper() -> None:
    """PTX for sm80 and sm90 in bf16 with every edge (the interpreter cannot check lowering)."""
    compile_for_gpus('''
from jitney.worker.triton_skinny import _skinny_kernel
types = ["*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "i32", "i32", "i32", "i32", "i32", "fp32"]
for arch in (80, 90):
    for prologue, add in ((0, False), (1, False), (2, True)):
        build(_skinny_kernel, types, dict(PROLOGUE=prologue, ADD=add, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=16,
                                          BLOCK_K=256, F32_DOT=False, SOFT_BF16=False), arch)
print("compiled")
''')


def test_measured_norm_variants_stay_close_to_the_norm() -> None:
    """bench/gpu_kernels.py times "norm_late" (rows scaled after the product) against "norm": same
    product to bf16 rounding; "scale" is the product of x times the norm weight."""
    g = torch.Generator().manual_seed(6)
    x = rand(g, 3, 64, dtype=torch.bfloat16, scale=2.0)
    w, nw = rand(g, 24, 64, dtype=torch.bfloat16, scale=0.1), rand(g, 64, dtype=torch.bfloat16)
    late = skinny_linear(dev(x), dev(w), prologue="norm_late", norm_weight=dev(nw), eps=EPS)
    close(late, ref_linear(ref_norm(x, nw), w, None))
    scaled = skinny_linear(dev(x), dev(w), prologue="scale", norm_weight=dev(nw))
    close(scaled, ref_linear((x.float() * nw.float()).to(torch.bfloat16), w, None))
