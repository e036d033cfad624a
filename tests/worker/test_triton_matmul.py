"""The batch-invariant Triton matmul: against torch, and bit-exact per row whatever the batch.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors
(``TRITON_INTERPRET`` is set before the kernel module is first imported);
with CUDA the same cases run compiled on the GPU. References run in float32
on the CPU. Sizes are tiny (the interpreter runs every program in numpy) but
M, N and K are not multiples of the tiles, so every mask is exercised.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.support.triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker.kernels.triton.matmul import (  # noqa: E402
    TritonInvariantLinear, matmul, tile_config, use_invariant_linears)

skip_unless_interpreted(triton)
# (atol, rtol) against the float32 reference: the output's rounding plus float32 sums of a short K.
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-3, 8e-3)}
# M spread over one tile (64 rows), its edges and past it.
BATCHES = [1, 2, 3, 7, 16, 17, 33, 64, 65]


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 ``x @ weight.T + bias`` on the CPU."""
    y = x.cpu().float() @ weight.cpu().float().T
    return y + bias.cpu().float() if bias is not None else y


def problem(seed: int, m: int, n: int, k: int, dtype: torch.dtype,
            bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x, w = rand(g, m, k, dtype=dtype).to(DEVICE), (rand(g, n, k) / 4).to(dtype).to(DEVICE)
    return x, w, rand(g, n, dtype=dtype).to(DEVICE) if bias else None


def cancelling(x: torch.Tensor, w: torch.Tensor) -> None:
    """In place: a 4096 in each row's first and last product, cancelling (4096 - 4096).

    The float32 accumulator then holds ~2^12 while the small products pass
    through it, so a change of summation order shows even after rounding to
    bfloat16 (~15% of the outputs flip where they otherwise would ~0.02%).
    """
    x[:, 0] = x[:, -1] = 4096
    w[:, 0], w[:, -1] = 1, -1


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 100), (67, 72, 100), (5, 1100, 48), (3, 24, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matmul_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    x, w, b = problem(m * n + k, m, n, k, dtype, bias)
    got = matmul(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype and got.device == x.device
    want = reference(x, w, b)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want, atol=atol, rtol=rtol)
    if dtype != torch.float32:  # rounded once, to nearest even: all but rare ties of the sum order agree
        # (at most 1%, or one output of a small product: on an H200 one of (1, 40)'s 40 did)
        differ = int((got.cpu() != want.to(dtype)).sum())
        assert differ <= max(1, got.numel() // 100), f"{differ} of {got.numel()} outputs differ"


def test_matmul_takes_row_strides_and_empty_shapes() -> None:
    g = torch.Generator().manual_seed(3)
    wide = rand(g, 9, 120, dtype=torch.bfloat16).to(DEVICE)
    w = rand(g, 30, 100, dtype=torch.bfloat16).to(DEVICE)
    x = wide[:, 10:110]  # row stride 120 != K
    assert torch.equal(matmul(x, w), matmul(x.contiguous(), w))
    assert matmul(x[:0], w).shape == (0, 30)
    assert matmul(x, w[:0]).shape == (9, 0)


@pytest.mark.parametrize("dtype,n,k", [(torch.bfloat16, 72, 100), (torch.bfloat16, 40, 64), (torch.float32, 72, 100)],
                         ids=["bf16-k-tail", "bf16-even-k", "fp32-k-tail"])
def test_rows_are_bit_identical_whatever_the_batch(dtype: torch.dtype, n: int, k: int) -> None:
    """Every row of an M-row batch equals that row computed alone, and moving it changes nothing.

    The interpreter's tile product is numpy's, which sums each element the
    same way whatever the tile's row count: this catches a reduction order
    (BLOCK_K, split-K) that follows M, not a BLOCK_M that does (see the
    launch test below; the CUDA test checks the compiled bits).
    """
    x, w, b = problem(n + k, max(BATCHES), n, k, dtype)
    cancelling(x, w)
    alone = torch.cat([matmul(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in BATCHES:
        assert torch.equal(matmul(x[:m], w, b), alone[:m]), f"M={m}"
    for shift in (1, 17, 40):
        assert torch.equal(matmul(x.roll(shift, 0), w, b), alone.roll(shift, 0)), f"rolled by {shift}"
    assert torch.equal(matmul(x[20:23], w, b), alone[20:23])


def test_launch_depends_on_n_k_and_dtype_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every M launches the same kernel specialisation: only the grid (and M itself) follow M."""
    import jitney.worker.kernels.triton.matmul as module

    launches: list[tuple[tuple[int, ...], dict[str, object]]] = []

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(module, "_matmul_kernel", Spy())
    x, w, b = problem(0, max(BATCHES), 72, 100, torch.bfloat16)
    for m in BATCHES:
        matmul(x[:m], w, b)
    assert [grid for grid, _ in launches] == [(3, -(-m // 64)) for m in BATCHES]
    assert all(kwargs == launches[0][1] for _, kwargs in launches)


def test_tile_config_depends_on_n_k_and_dtype_only() -> None:
    assert tile_config(576, 1536, torch.bfloat16) == (64, 32, 64, 4, 4)
    assert tile_config(4096, 4096, torch.bfloat16) == (64, 64, 64, 4, 4)
    assert tile_config(128256, 4096, torch.float16) == (64, 128, 64, 4, 3)
    assert tile_config(4096, 4096, torch.float32) == (64, 64, 32, 4, 3)
    assert tile_config(72, 7, torch.bfloat16).block_k == 16


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(48, 40)
        self.inner = nn.Sequential(nn.SiLU(), nn.Linear(40, 24, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.up(x))


def test_use_invariant_linears_swaps_every_linear() -> None:
    torch.manual_seed(0)
    model = Tiny().to(DEVICE)
    x = torch.randn(2, 5, 48, device=DEVICE)  # leading dims are flattened, as nn.Linear allows
    want = model(x)
    weight, keys = model.up.weight, sorted(model.state_dict())
    assert use_invariant_linears(model) == 2
    assert not any(isinstance(mod, nn.Linear) for mod in model.modules())
    assert isinstance(model.up, TritonInvariantLinear) and isinstance(model.inner[1], TritonInvariantLinear)
    assert model.up.weight is weight and model.inner[1].bias is None  # the parameters, not copies
    assert sorted(model.state_dict()) == keys
    got = model(x)
    assert got.shape == (2, 5, 24)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert use_invariant_linears(model) == 0


def _args() -> dict[str, torch.Tensor | None]:
    return {"x": torch.zeros(3, 16, device=DEVICE), "weight": torch.zeros(8, 16, device=DEVICE),
            "bias": torch.zeros(8, device=DEVICE)}


BAD: dict[str, tuple[Callable[[dict], None], str]] = {
    "x 1-d": (lambda a: a.update(x=a["x"][0]), "x must be 2-d \\(M, K\\)"),
    "x int": (lambda a: a.update(x=a["x"].long()), "x dtype must be one of"),
    "x column stride": (lambda a: a.update(x=torch.zeros(16, 3, device=DEVICE).t()), "x must have unit stride"),
    "weight 3-d": (lambda a: a.update(weight=a["weight"].view(2, 4, 16)), "weight must be 2-d \\(N, K\\)"),
    "weight K": (lambda a: a.update(weight=a["weight"][:, :15]), "weight must be \\(N, 16\\)"),
    "weight column stride": (lambda a: a.update(weight=torch.zeros(16, 8, device=DEVICE).t()),
                             "weight must have unit stride"),
    "weight dtype": (lambda a: a.update(weight=a["weight"].half()), "weight dtype torch.float16 != x dtype"),
    "weight device": (lambda a: a.update(weight=torch.zeros(8, 16, device="meta")), "weight is on meta"),
    "bias shape": (lambda a: a.update(bias=a["bias"][:7]), "bias must be \\(8,\\)"),
    "bias dtype": (lambda a: a.update(bias=a["bias"].bfloat16()), "bias is torch.bfloat16"),
    "bias stride": (lambda a: a.update(bias=torch.zeros(16, device=DEVICE)[::2]), "bias must be contiguous"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_matmul_rejects_bad_arguments(case: str) -> None:
    args = _args()
    mutate, message = BAD[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        matmul(args["x"], args["weight"], args["bias"])  # type: ignore[arg-type]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU-tensor check")
def test_matmul_rejects_cpu_tensors_when_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        matmul(torch.zeros(2, 16), torch.zeros(8, 16))


cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (49152, 576)])
def test_matmul_on_cuda_is_batch_invariant_at_model_sizes(n: int, k: int) -> None:
    """Compiled: against torch, and each row's bits alone == in any batch (where cuBLAS may differ)."""
    x, w, b = problem(n + k, 300, n, k, torch.bfloat16)
    cancelling(x, w)
    probe = [0, 1, 16, 63, 64, 299]
    alone = {i: matmul(x[i : i + 1], w, b) for i in probe}
    for m in [1, 2, 3, 7, 16, 17, 33, 64, 65, 129, 256, 300]:
        out = matmul(x[:m], w, b)
        assert all(torch.equal(out[i : i + 1], alone[i]) for i in probe if i < m), f"M={m}"
    torch.testing.assert_close(out.float().cpu(), reference(x, w, b), atol=5e-2, rtol=1.6e-2)
    rolled = matmul(x.roll(7, 0), w, b)
    assert all(torch.equal(rolled[(i + 7) % 300 : (i + 7) % 300 + 1], alone[i]) for i in probe)


@pytest.mark.cuda
@cuda_only
def test_matmul_replays_in_a_cuda_graph() -> None:
    x, w, b = problem(5, 17, 576, 1536, torch.bfloat16)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        matmul(static, w, b)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul(static, w, b)
    static.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul(x.flip(0), w, b))


COMPILE = """
import torch
from jitney.worker.kernels.triton import matmul as k

assert [p.name for p in k._matmul_kernel.params if p.do_not_specialize] == ["M"]  # one binary for every M
dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
shapes = ((576, 1536, True), (4096, 4100, False), (128256, 4096, False))  # (N, K, bias)
for arch, dts in ((80, ("bf16", "fp32")), (90, ("bf16", "fp16"))):
    for dt in dts:
        # bf16: each BLOCK_N of tile_config, a K tail, a bias; the other dtypes: the first shape
        for n, kk, bias in shapes if dt == "bf16" else shapes[:1]:
            cfg = k.tile_config(n, kk, dtypes[dt])
            build(k._matmul_kernel, [f"*{dt}"] * 4 + ["i32"] * 6,
                  dict(HAS_BIAS=bias, EVEN_K=kk % cfg.block_k == 0, F32_DOT=dt == "fp32", BLOCK_M=cfg.block_m,
                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SOFT_BF16=False), arch)
print("compiled")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA compiler ships for Linux only")
def test_matmul_compiles_for_sm80_and_sm90_without_a_gpu() -> None:
    """What the interpreter cannot check: the kernel lowers to PTX (Ampere, Hopper)."""
    compile_for_gpus(COMPILE)
