"""The fused decoder-layer kernels against plain torch references.

Without CUDA they run under the Triton interpreter on CPU tensors
(``TRITON_INTERPRET`` is set before the kernel module is first imported);
with CUDA the same cases run compiled on the GPU. The references run on
CPU. Sizes are tiny: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker.kernels.triton.fused import fused_add_rms_norm, rms_norm, rope_write_kv, silu_mul  # noqa: E402

skip_unless_interpreted(triton)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}
EPS = 1e-6


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


def mostly_exact(got: torch.Tensor, want: torch.Tensor, fraction: float = 0.99) -> None:
    """The rounding structure is mirrored: all but the rare reduction-order tie flip agree."""
    close(got, want)
    if want.dtype != torch.float32:
        assert (got.cpu() == want).float().mean().item() >= fraction


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def on_device(t: torch.Tensor) -> torch.Tensor:
    """A copy on the test device (never an alias, even on CPU), strides kept."""
    return t.to(DEVICE, copy=True)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, d) rotated in float32, rounded once."""
    half = x.shape[-1] // 2
    c, s = cos_sin[positions, :half], cos_sin[positions, half:]
    cos, sin = torch.cat((c, c), -1)[:, None], torch.cat((s, s), -1)[:, None]
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def make_cos_sin(max_positions: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("tokens", [1, 3, 7])
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(hidden + tokens)
    wide = rand(g, tokens, hidden + 8, dtype=dtype) * 3
    x = wide[:, 5 : 5 + hidden]  # row stride != hidden
    weight = (1 + 0.1 * rand(g, hidden)).to(dtype)
    got = rms_norm(on_device(wide)[:, 5 : 5 + hidden], weight.to(DEVICE), EPS)
    assert got.shape == x.shape and got.dtype == dtype
    mostly_exact(got, ref_rms_norm(x, weight))


def test_rms_norm_is_batch_invariant() -> None:
    g = torch.Generator().manual_seed(1)
    x = rand(g, 7, 576, dtype=torch.bfloat16).to(DEVICE) * 2
    weight = (1 + 0.1 * rand(g, 576)).to(torch.bfloat16).to(DEVICE)
    full = rms_norm(x, weight, EPS)
    for i in range(7):
        assert torch.equal(rms_norm(x[i : i + 1], weight, EPS), full[i : i + 1])
    assert torch.equal(rms_norm(x[2:5], weight, EPS), full[2:5])


def test_rms_norm_into_out_and_in_place() -> None:
    g = torch.Generator().manual_seed(2)
    x = rand(g, 3, 64, dtype=torch.float16).to(DEVICE)
    weight = rand(g, 64).half().to(DEVICE)
    want = ref_rms_norm(x.cpu(), weight.cpu())
    out = torch.zeros(3, 80, dtype=torch.float16, device=DEVICE)
    assert rms_norm(x, weight, EPS, out=out[:, :64]).data_ptr() == out.data_ptr()
    mostly_exact(out[:, :64], want)
    assert not out[:, 64:].any()
    rms_norm(x, weight, EPS, out=x)
    mostly_exact(x, want)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_in_place(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(hidden * tokens)
    wide = rand(g, tokens, 2 * hidden + 4, dtype=dtype)
    x0, r0 = wide[:, :hidden], wide[:, hidden + 4 :]  # strided views into one buffer
    weight = (1 + 0.1 * rand(g, hidden)).to(dtype)
    buf = on_device(wide)
    x, residual = buf[:, :hidden], buf[:, hidden + 4 :]
    fused_add_rms_norm(x, residual, weight.to(DEVICE), EPS)
    new_residual = x0 + r0
    assert torch.equal(residual.cpu(), new_residual)  # the add rounds exactly as torch's
    mostly_exact(x, ref_rms_norm(new_residual, weight))
    assert torch.equal(buf[:, hidden : hidden + 4].cpu(), wide[:, hidden : hidden + 4])  # gap untouched


@pytest.mark.parametrize("tokens,inter", [(1, 64), (3, 576), (2, 1536)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_reference(dtype: torch.dtype, tokens: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter + tokens)
    wide = rand(g, tokens, 2 * inter + 6, dtype=dtype) * 3
    gate_up = wide[:, 3 : 3 + 2 * inter]
    got = silu_mul(on_device(wide)[:, 3 : 3 + 2 * inter])
    assert got.shape == (tokens, inter) and got.dtype == dtype
    close(got, ref_silu_mul(gate_up))
    out = torch.zeros(tokens, inter + 5, dtype=dtype, device=DEVICE)
    silu_mul(on_device(gate_up), out=out[:, :inter])
    assert torch.equal(out[:, :inter], got) and not out[:, inter:].any()


# (num_heads, num_kv_heads, head_dim)
ROPE_GEOMETRIES = [(4, 2, 64), (3, 1, 128)]


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("geometry", ROPE_GEOMETRIES, ids=lambda g: "nh{}-kvh{}-d{}".format(*g))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_write_kv_matches_reference(dtype: torch.dtype, geometry: tuple[int, int, int], tokens: int) -> None:
    nh, kvh, d = geometry
    g = torch.Generator().manual_seed(nh * d + tokens)
    num_blocks, block_size, max_pos = 4, 8, 64
    width = (nh + 2 * kvh) * d
    wide = rand(g, tokens, width + 8, dtype=dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1  # padding: q rotated, nothing cached
    k_cache0 = rand(g, num_blocks, block_size, kvh, d, dtype=dtype)
    v_cache0 = rand(g, num_blocks, block_size, kvh, d, dtype=dtype)
    cos_sin = make_cos_sin(max_pos, d)

    buf = on_device(wide)
    qkv = buf[:, 4 : 4 + width]  # row stride != width
    k_cache, v_cache = on_device(k_cache0), on_device(v_cache0)
    rope_write_kv(
        qkv, positions.to(DEVICE), cos_sin.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), nh, kvh, d
    )

    q0, k0, v0 = wide[:, 4 : 4 + width].split([nh * d, kvh * d, kvh * d], dim=1)
    close(qkv[:, : nh * d].reshape(tokens, nh, d), ref_rope(q0.reshape(tokens, nh, d), positions, cos_sin))
    assert torch.equal(qkv[:, nh * d :].cpu(), wide[:, 4 + nh * d : 4 + width])  # k, v columns untouched
    assert torch.equal(buf[:, :4].cpu(), wide[:, :4]) and torch.equal(buf[:, 4 + width :].cpu(), wide[:, 4 + width :])
    keep = slots >= 0
    want_k, want_v = k_cache0.flatten(0, 1).clone(), v_cache0.flatten(0, 1).clone()
    want_k[slots[keep]] = ref_rope(k0.reshape(tokens, kvh, d), positions, cos_sin)[keep]
    want_v[slots[keep]] = v0.reshape(tokens, kvh, d)[keep]
    close(k_cache.flatten(0, 1), want_k)
    assert torch.equal(v_cache.cpu().flatten(0, 1), want_v)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(k_cache.cpu().flatten(0, 1)[untouched], k_cache0.flatten(0, 1)[untouched])


def _rope_args() -> dict[str, object]:
    nh, kvh, d = 2, 1, 64
    return {
        "qkv": torch.zeros(3, (nh + 2 * kvh) * d, device=DEVICE),
        "positions": torch.arange(3, device=DEVICE),
        "cos_sin": make_cos_sin(8, d).to(DEVICE),
        "k_cache": torch.zeros(2, 4, kvh, d, device=DEVICE),
        "v_cache": torch.zeros(2, 4, kvh, d, device=DEVICE),
        "slot_mapping": torch.arange(3, device=DEVICE),
        "num_heads": nh, "num_kv_heads": kvh, "head_dim": d,
    }


BAD_ROPE: dict[str, tuple[Callable[[dict], None], str]] = {
    "qkv width": (lambda a: a.update(qkv=a["qkv"][:, :-1]), "qkv must be \\(T, 256\\)"),
    "qkv 3-d": (lambda a: a.update(qkv=a["qkv"].view(3, 4, 64)), "qkv must be"),
    "qkv column stride": (lambda a: a.update(qkv=a["qkv"].t().contiguous().t()), "unit stride"),
    "qkv int": (lambda a: a.update(qkv=a["qkv"].long()), "qkv dtype"),
    "cache dtype": (lambda a: a.update(k_cache=a["k_cache"].half()), "k_cache is torch.float16"),
    "cache heads": (lambda a: a.update(num_kv_heads=2, num_heads=0), "heads >= 1"),
    "odd head_dim": (lambda a: a.update(head_dim=63), "even head_dim"),
    "v_cache shape": (lambda a: a.update(v_cache=a["v_cache"][:1]), "v_cache must be"),
    "cache not contiguous": (
        lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "contiguous",
    ),
    "cos_sin half": (lambda a: a.update(cos_sin=a["cos_sin"].half()), "cos_sin must be float32"),
    "cos_sin width": (lambda a: a.update(cos_sin=a["cos_sin"][:, :32]), "cos_sin must be"),
    "float positions": (lambda a: a.update(positions=a["positions"].float()), "positions must be int32 or int64"),
    "short slots": (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), "slot_mapping must be \\(3,\\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROPE))
def test_rope_write_kv_rejects_bad_arguments(case: str) -> None:
    args = _rope_args()
    mutate, message = BAD_ROPE[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        rope_write_kv(**args)  # type: ignore[arg-type]


def test_norms_and_silu_reject_bad_arguments() -> None:
    x = torch.zeros(3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be \\(64,\\)"):
        rms_norm(x, w[:32], EPS)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, w.half(), EPS)
    with pytest.raises(ValueError, match="x must be \\(T, width\\)"):
        rms_norm(x[0], w, EPS)
    with pytest.raises(ValueError, match="x dtype must be one of"):
        rms_norm(x.double(), w.double(), EPS)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(torch.zeros(64, 3, device=DEVICE).t(), w, EPS)
    with pytest.raises(ValueError, match="out has 2 rows"):
        rms_norm(x, w, EPS, out=x[:2].clone())
    with pytest.raises(ValueError, match="residual must be \\(T, 64\\)"):
        fused_add_rms_norm(x, torch.zeros(3, 32, device=DEVICE), w, EPS)
    with pytest.raises(ValueError, match="residual dtype torch.float16"):
        fused_add_rms_norm(x, x.half(), w, EPS)
    with pytest.raises(ValueError, match="different tensors"):
        fused_add_rms_norm(x, x, w, EPS)
    with pytest.raises(ValueError, match="must be even"):
        silu_mul(torch.zeros(3, 63, device=DEVICE))
    with pytest.raises(ValueError, match="out must be \\(T, 32\\)"):
        silu_mul(x, out=torch.zeros(3, 64, device=DEVICE))
    with pytest.raises(ValueError, match="out dtype torch.bfloat16"):
        silu_mul(x, out=torch.zeros(3, 32, dtype=torch.bfloat16, device=DEVICE))


cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)


def _layer_state(seed: int) -> dict[str, torch.Tensor]:
    """Everything one captured decoder-layer slice reads or writes (bf16, 5 tokens, one padded)."""
    g = torch.Generator().manual_seed(seed)
    nh, kvh, d, hidden, inter, tokens = 4, 2, 128, 576, 1536, 5
    slots = torch.randperm(64, generator=g)[:tokens]
    slots[-1] = -1
    state = {
        "x": rand(g, tokens, hidden), "residual": rand(g, tokens, hidden), "weight": 1 + 0.1 * rand(g, hidden),
        "gate_up": rand(g, tokens, 2 * inter), "qkv": rand(g, tokens, (nh + 2 * kvh) * d),
        "k_cache": rand(g, 8, 8, kvh, d), "v_cache": rand(g, 8, 8, kvh, d),
    }
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    state.update(positions=torch.randint(0, 32, (tokens,), generator=g), slots=slots, cos_sin=make_cos_sin(32, d))
    return {k: v.cuda() for k, v in state.items()}


def _layer_step(s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    fused_add_rms_norm(s["x"], s["residual"], s["weight"], EPS)
    normed = rms_norm(s["residual"], s["weight"], EPS)
    rope_write_kv(s["qkv"], s["positions"], s["cos_sin"], s["k_cache"], s["v_cache"], s["slots"], 4, 2, 128)
    return normed, silu_mul(s["gate_up"])


@pytest.mark.cuda
@cuda_only
def test_wrappers_replay_in_a_cuda_graph() -> None:
    static = _layer_state(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer_step(_layer_state(0))  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _layer_step(static)
    fresh, eager = _layer_state(1), _layer_state(1)
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    graph.replay()
    want = _layer_step(eager)
    torch.cuda.synchronize()
    for name in ("x", "residual", "qkv", "k_cache", "v_cache"):
        assert torch.equal(static[name], eager[name]), name
    assert all(torch.equal(got, w) for got, w in zip(outputs, want))


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("hidden", [576, 2048, 4096, 8192])
def test_rms_norm_on_cuda_at_model_sizes(hidden: int) -> None:
    """Against torch on the GPU, and batch invariant at every size a model uses."""
    g = torch.Generator().manual_seed(hidden)
    x = (rand(g, 33, hidden) * 3).to(torch.bfloat16).cuda()
    weight = (1 + 0.1 * rand(g, hidden)).to(torch.bfloat16).cuda()
    full = rms_norm(x, weight, EPS)
    mostly_exact(full, ref_rms_norm(x, weight).cpu())
    for rows in (slice(0, 1), slice(5, 6), slice(3, 10)):
        assert torch.equal(rms_norm(x[rows], weight, EPS), full[rows])


COMPILE = """
from jitney.worker.kernels.triton import fused as k

for arch, dts in ((80, ("bf16", "fp32")), (90, ("bf16", "fp16"))):
    for dt in dts:
        norm = [f"*{dt}"] * 3 + ["i32"] * 2 + ["fp32"]
        build(k._rms_norm_kernel, norm, dict(H=576, BLOCK=1024, SOFT_BF16=False), arch)
        build(k._add_rms_norm_kernel, norm, dict(H=1536, BLOCK=2048, SOFT_BF16=False), arch)
        build(k._silu_mul_kernel, [f"*{dt}"] * 2 + ["i32"] * 3, dict(BLOCK=1024, SOFT_BF16=False), arch)
        build(k._rope_write_kv_kernel, [f"*{dt}", "*i64", "*fp32", f"*{dt}", f"*{dt}", "*i64"] + ["i32"] * 3,
              dict(NUM_HEADS=9, NUM_KV_HEADS=3, HEAD_DIM=64, HALF_P=32, NH_P=16, KVH_P=4, SOFT_BF16=False), arch)
print("compiled")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA compiler ships for Linux only")
def test_fused_kernels_compile_for_sm80_and_sm90_without_a_gpu() -> None:
    """What the interpreter cannot check: the kernels lower to PTX (Ampere, Hopper)."""
    compile_for_gpus(COMPILE)
