"""The skinny linear kernel (``worker/kernels/triton/skinny.py``) against a torch reference,
its module swap, and the tuned files that choose where it runs.

Without CUDA it runs under the Triton interpreter on CPU tensors; with CUDA
the same cases run compiled. The reference is ``F.linear``'s rounding
(float32 accumulation, rounded once after the bias); only the order of the
sums differs, so results agree to the dtype's rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker.attention import triton as triton_attention
from jitney.worker.kernels.triton import skinny as triton_skinny
from jitney.worker.runner import tuned_configs  # noqa: E402
from jitney.worker.kernels.triton.skinny import (MAX_ROWS, SkinnyConfig, SkinnyLinear, skinny_config,  # noqa: E402
                                         skinny_linear, use_skinny_linears)

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
    ("dtype", "x is torch.float16"),
    ("out_shape", "out must be"),
    ("bias", "bias must be"),
    ("weight", "contiguous \\(N, K\\)"),
])
def test_bad_arguments_are_refused(case: str, message: str) -> None:
    w = torch.zeros(8, 16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    kwargs: dict = {}
    if case == "rows":
        x = torch.zeros(MAX_ROWS + 1, 16, device=DEVICE)
    elif case == "width":
        x = torch.zeros(2, 12, device=DEVICE)
    elif case == "dtype":
        x = x.half()
    elif case == "out_shape":
        kwargs["out"] = torch.zeros(2, 9, device=DEVICE)
    elif case == "bias":
        kwargs["bias"] = torch.zeros(7, device=DEVICE)
    elif case == "weight":
        w = torch.zeros(16, 8, device=DEVICE).T
    with pytest.raises(ValueError, match=message):
        skinny_linear(x, w, **kwargs)


def test_swapped_linears_run_skinny_up_to_their_rows_and_torch_above() -> None:
    """Only shapes in CONFIGS are swapped, each up to min(max_rows, its own max_rows); more rows take F.linear."""
    g = torch.Generator().manual_seed(7)
    net = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24, bias=False), nn.Linear(24, 8)).to(DEVICE)
    try:
        triton_skinny.CONFIGS[(40, 24)] = SkinnyConfig(16, 32, 4, 2, 4)
        triton_skinny.CONFIGS[(24, 40)] = SkinnyConfig(16, 32, 4, 2, 64)
        assert sorted(use_skinny_linears(net, max_rows=8)) == [(24, 40), (40, 24)]
    finally:
        triton_skinny.CONFIGS.clear()
    assert [type(m).__name__ for m in net] == ["SkinnyLinear", "SkinnyLinear", "Linear"]
    assert (net[0].max_rows, net[1].max_rows) == (4, 8)
    calls = []
    kernel = triton_skinny.skinny_linear
    triton_skinny.skinny_linear = lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k)  # type: ignore[assignment]
    try:
        for m in (1, 4, 5, 9):
            x = rand(g, m, 24, dtype=torch.float32)
            want = ref_linear(ref_linear(x, net[0].weight.cpu(), net[0].bias.cpu()), net[1].weight.cpu(), None)
            close(net[1](net[0](dev(x))), want)
    finally:
        triton_skinny.skinny_linear = kernel  # type: ignore[assignment]
    assert calls == [1, 1, 4, 4, 5]   # layer 0 up to 4 rows, layer 1 up to 8


def test_tuned_file_sets_the_launch_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A card's file: skinny configs by shape, attention by head layout ("*" for others), skinny_rows;
    a damaged file changes nothing."""
    data = {"device": "Card X", "skinny": {"960x576": [32, 128, 4, 3, 16]}, "skinny_rows": 16,
            "attention": {"32/8": {"prefill_rows": 128, "block_n": 64, "prefill": [8, 2], "decode": [4, 2]},
                          "*": {"prefill_rows": 64, "block_n": 32, "prefill": [4, None]}}}
    saved = (dict(triton_skinny.CONFIGS), triton_attention.PREFILL_ROWS, triton_attention.BLOCK_N,
             dict(triton_attention.LAUNCH))
    try:
        assert tuned_configs.apply_data(data, (32, 8)) == 16
        assert triton_skinny.CONFIGS[(960, 576)] == SkinnyConfig(32, 128, 4, 3, 16)
        assert (triton_attention.PREFILL_ROWS, triton_attention.BLOCK_N) == (128, 64)
        assert triton_attention.LAUNCH == {"prefill": (8, 2), "decode": (4, 2)}
        tuned_configs.apply_data(data, (9, 3))
        assert (triton_attention.PREFILL_ROWS, triton_attention.BLOCK_N) == (64, 32)
        assert triton_attention.LAUNCH["prefill"] == (4, None)
        with pytest.raises(ValueError, match="out of"):
            tuned_configs.apply_data({**data, "skinny_rows": 65}, (32, 8))
        # found by card name, $JITNEY_TUNED_CONFIGS first
        assert tuned_configs.file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
        (tmp_path / "Card_X.json").write_text(json.dumps(data))
        monkeypatch.setenv("JITNEY_TUNED_CONFIGS", str(tmp_path))
        assert tuned_configs.find("Card X") == tmp_path / "Card_X.json"
        assert tuned_configs.find("Card Y") is None
    finally:
        triton_skinny.CONFIGS.clear()
        triton_skinny.CONFIGS.update(saved[0])
        triton_attention.PREFILL_ROWS, triton_attention.BLOCK_N = saved[1], saved[2]
        triton_attention.LAUNCH.clear()
        triton_attention.LAUNCH.update(saved[3])


def test_shipped_tuned_files_parse() -> None:
    for path in sorted(tuned_configs.FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        assert tuned_configs.file_name(data["device"]) == path.name
        for key, value in data.get("skinny", {}).items():
            assert len(key.split("x")) == 2 and len(value) == 5 and 1 <= value[-1] <= MAX_ROWS


def test_compiles_for_ampere_and_hopper() -> None:
    """PTX for sm80 and sm90 in bf16, with and without a bias (the interpreter cannot check lowering)."""
    compile_for_gpus('''
from jitney.worker.kernels.triton.skinny import _skinny_kernel
types = ["*bf16", "*bf16", "*bf16", "*bf16", "i32", "i32", "i32", "i32", "i32"]
for arch in (80, 90):
    for bias in (False, True):
        build(_skinny_kernel, types, dict(HAS_BIAS=bias, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, F32_DOT=False,
                                          SOFT_BF16=False), arch)
print("compiled")
''')
