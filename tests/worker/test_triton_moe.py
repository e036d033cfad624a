"""The Triton fused-MoE kernel (``kernels/triton/moe.py``): against a float64 loop over
the routed experts, and bit-exact per token whatever else the step routes.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors. Shapes are
tiny (the interpreter runs every program in numpy) but H and I are not multiples of
the tiles, an expert gets more than one block of 64 rows, and some experts none.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support.triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker.kernels.triton.moe import BLOCK_M, _sorted_blocks, fused_experts  # noqa: E402

skip_unless_interpreted(triton)

E, H, INTER = 6, 40, 24
# (atol, rtol) against float64: the roundings of gate, up and act to the dtype (bf16: 3 of them).
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (6e-2, 3e-2)}


def layer(seed: int, dtype: torch.dtype, bias: bool) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor | None] = {
        "gate_up": (torch.randn(E, 2 * INTER, H, generator=g) / 4).to(dtype).to(DEVICE),
        "down": (torch.randn(E, H, INTER, generator=g) / 4).to(dtype).to(DEVICE),
        "gate_up_bias": None, "down_bias": None}
    if bias:
        out["gate_up_bias"] = torch.randn(E, 2 * INTER, generator=g).to(dtype).to(DEVICE)
        out["down_bias"] = torch.randn(E, H, generator=g).to(dtype).to(DEVICE)
    return out


def routing(seed: int, tokens: int, k: int, experts: tuple[int, ...] = tuple(range(E))) -> tuple[torch.Tensor, ...]:
    """k distinct experts per token (from ``experts``), weights summing to 1, in descending order."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts), generator=g)[:k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1).sort(dim=-1, descending=True).values
    return ids.to(DEVICE), weights.to(DEVICE)


def reference(x: torch.Tensor, w: dict[str, torch.Tensor | None], ids: torch.Tensor, weights: torch.Tensor,
              activation: str) -> torch.Tensor:
    """float64, token by token, slot by slot."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    gate_up, down = w["gate_up"].cpu().double(), w["down"].cpu().double()  # type: ignore[union-attr]
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gu = gate_up[e] @ x[t].cpu().double()
            if w["gate_up_bias"] is not None:
                gu = gu + w["gate_up_bias"][e].cpu().double()
            gate, up = gu[:INTER], gu[INTER:]
            if activation == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            y = down[e] @ act
            if w["down_bias"] is not None:
                y = y + w["down_bias"][e].cpu().double()
            out[t] += float(weights[t, s]) * y
    return out


def run(x: torch.Tensor, w: dict[str, torch.Tensor | None], ids: torch.Tensor, weights: torch.Tensor,
        activation: str = "silu") -> torch.Tensor:
    return fused_experts(x, w["gate_up"], w["down"], ids, weights, w["gate_up_bias"], w["down_bias"],  # type: ignore[arg-type]
                         activation=activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("gpt_oss", True)])
def test_fused_experts_match_a_float64_loop(dtype: torch.dtype, activation: str, bias: bool) -> None:
    w = layer(1, dtype, bias)
    # 70 tokens, top-2 of experts 0, 2, 3: 140 pairs over 3 experts, so one expert gets two
    # blocks of 64, three experts none, and the grid's last blocks name no expert.
    ids, weights = routing(2, 70, 2, experts=(0, 2, 3))
    x = torch.randn(70, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    got = run(x, w, ids, weights, activation)
    assert got.dtype == dtype and got.shape == (70, H)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu().double(), reference(x, w, ids, weights, activation), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_bits_do_not_depend_on_the_rest_of_the_step(dtype: torch.dtype) -> None:
    w = layer(4, dtype, bias=True)
    ids, weights = routing(5, 40, 3)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    batched = run(x, w, ids, weights)
    for t in (0, 17, 39):    # alone: its pairs land at other rows of their experts' blocks
        assert torch.equal(run(x[t:t + 1], w, ids[t:t + 1], weights[t:t + 1])[0], batched[t])
    flip = torch.arange(39, -1, -1, device=DEVICE)
    assert torch.equal(run(x[flip], w, ids[flip], weights[flip]), batched[flip])


def test_float_output_and_empty_steps() -> None:
    w = layer(7, torch.bfloat16, bias=False)
    ids, weights = routing(8, 5, 2)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    unrounded = fused_experts(x, w["gate_up"], w["down"], ids, weights, out_float=True)  # type: ignore[arg-type]
    assert unrounded.dtype == torch.float32
    assert torch.equal(unrounded.to(torch.bfloat16), run(x, w, ids, weights))
    empty = fused_experts(x[:0], w["gate_up"], w["down"], ids[:0], weights[:0])  # type: ignore[arg-type]
    assert empty.shape == (0, H) and empty.dtype == torch.bfloat16


def test_blocks_cover_each_experts_pairs_in_token_order() -> None:
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]] * 30, device=DEVICE)     # 180 pairs: expert 2 has 90
    order, block_expert, firsts, starts, counts = (t.cpu() for t in _sorted_blocks(ids, E))
    assert counts.tolist() == [60, 0, 90, 0, 0, 30]
    used = block_expert[block_expert >= 0].tolist()
    assert used == [0, 2, 2, 5]                        # ceil(60/64), ceil(90/64), ceil(30/64) blocks
    assert (block_expert[len(used):] == -1).all() and len(block_expert) == -(-180 // BLOCK_M) + E
    flat = ids.reshape(-1).cpu()
    for e in (0, 2, 5):
        pairs = order[starts[e]: starts[e] + counts[e]]
        assert (flat[pairs] == e).all() and pairs.tolist() == sorted(pairs.tolist())
        assert block_expert[firsts[e]] == e


@pytest.mark.parametrize("case", ["activation", "down-shape", "routing-shape", "dtype", "bias-shape"])
def test_fused_experts_rejects_bad_arguments(case: str) -> None:
    w = layer(10, torch.float32, bias=False)
    ids, weights = routing(11, 3, 2)
    x = torch.randn(3, H).to(DEVICE)
    gate_up, down = w["gate_up"], w["down"]
    kwargs: dict[str, object] = {}
    if case == "activation":
        kwargs["activation"] = "relu"
    elif case == "down-shape":
        down = down[:, :, :-1]   # type: ignore[index]
    elif case == "routing-shape":
        weights = weights[:, :1]
    elif case == "dtype":
        x = x.to(torch.bfloat16)
    else:
        kwargs["down_bias"] = torch.zeros(E, H + 1, device=DEVICE)
    with pytest.raises(ValueError):
        fused_experts(x, gate_up, down, ids, weights, **kwargs)  # type: ignore[arg-type]


COMPILE = """
from jitney.worker.kernels.triton import moe as k
from jitney.worker.kernels.triton.matmul import tile_config
import torch

blocks = ["*i64"] * 5
for arch in (80, 90):
    for dt, f32 in (("bf16", False), ("fp32", True)):
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        h, inter = 2048, 768      # Qwen3-30B-A3B's experts
        up, dn = tile_config(inter, h, dtype), tile_config(h, inter, dtype)
        build(k._gate_up_kernel, [f"*{dt}"] * 4 + blocks + ["i32"] * 6 + ["fp32"] * 2,
              dict(HAS_BIAS=True, ACT=1, EVEN_K=True, F32_DOT=f32, BLOCK_M=k.BLOCK_M, BLOCK_N=up.block_n,
                   BLOCK_K=up.block_k, SOFT_BF16=False), arch)
        build(k._down_kernel, [f"*{dt}"] * 3 + ["*fp32"] * 2 + blocks + ["i32"] * 6,
              dict(HAS_BIAS=False, EVEN_K=True, F32_DOT=f32, BLOCK_M=k.BLOCK_M, BLOCK_N=dn.block_n,
                   BLOCK_K=dn.block_k), arch)
print("compiled")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA compiler ships for Linux only")
def test_fused_experts_compile_for_sm80_and_sm90_without_a_gpu() -> None:
    """What the interpreter cannot check: both kernels lower to PTX (Ampere, Hopper)."""
    compile_for_gpus(COMPILE)


def test_a_moe_layers_experts_on_the_kernel_match_its_torch_loop() -> None:
    """``FusedExperts.use_triton_kernel`` (how a model on CUDA runs its experts): the
    kernel's output agrees with the layer's own torch loop over the routed experts."""
    from jitney.worker.layers.moe import SparseMoe

    torch.manual_seed(12)
    moe = SparseMoe(H, INTER, E, 2, normalize=True).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(9, H, device=DEVICE)
    loop = moe.forward(x)
    assert moe.experts.use_triton_kernel()
    torch.testing.assert_close(moe.forward(x), loop, atol=1e-4, rtol=1e-4)
