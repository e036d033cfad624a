"""The CPU's mixture-of-experts experts (``csrc/moe.cpp``, ``InvariantMoeExperts``).

Checked against a dense float32 torch reference and transformers' own experts
modules, bit for bit against the composition of the CPU's linear and silu_mul
ops, and bit for bit against itself: a token alone, in batches of many sizes, at
other rows, chunked, and with 1, 2 or 3 threads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.invariance_driver import torch_threads
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.kernels.cpu.moe import (ACTIVATIONS, ExpertWeights, InvariantMoeExperts, from_gpt_oss_layout,
                                           shard_experts)

DTYPES = [torch.bfloat16, torch.float32]
ALPHA, LIMIT = 1.702, 7.0


def routing(tokens: int, experts: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k distinct experts, drawn unevenly (expert 0 by nearly every token, expert
    e > 0 about 2^(-e/2) as often as expert 1, the last quarter never), and softmax weights."""
    p = torch.tensor([0.5 ** (e / 2) for e in range(experts)])
    p[experts * 3 // 4:] = 0
    p[0] = 4 * p.sum()
    ids = torch.multinomial(p.expand(tokens, -1), k, replacement=False, generator=gen)
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)


def random_experts(experts: int, hidden: int, inter: int, gen: torch.Generator, bias: bool,
                   scale: float = 0.1) -> ExpertWeights:
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * scale
    down = torch.randn(experts, hidden, inter, generator=gen) * scale
    if not bias:
        return gate_up, down, None, None
    return gate_up, down, torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)


def cast(weights: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    gate_up, down, gate_up_bias, down_bias = weights
    return (gate_up.to(dtype), down.to(dtype), None if gate_up_bias is None else gate_up_bias.to(dtype),
            None if down_bias is None else down_bias.to(dtype))


def act_torch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=LIMIT)
    return (up.clamp(-LIMIT, LIMIT) + 1) * gate * torch.sigmoid(gate * ALPHA)


def reference(x: torch.Tensor, weights: ExpertWeights, ids: torch.Tensor, w: torch.Tensor,
              activation: str) -> torch.Tensor:
    """Dense float32: every (token, slot) through its expert, one slot at a time."""
    gate_up, down, gate_up_bias, down_bias = (None if t is None else t.float() for t in weights)
    assert gate_up is not None and down is not None
    x = x.float()
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for s in range(ids.shape[1]):
        e = ids[:, s]
        h = torch.einsum("tnh,th->tn", gate_up[e], x) + (0 if gate_up_bias is None else gate_up_bias[e])
        y = torch.einsum("thi,ti->th", down[e], act_torch(h[:, :inter], h[:, inter:], activation))
        out += w[:, s:s + 1].float() * (y + (0 if down_bias is None else down_bias[e]))
    return out


def layer(weights: ExpertWeights, activation: str = "silu", *, out_float: bool = False,
          portable: bool = False) -> InvariantMoeExperts:
    return InvariantMoeExperts(*weights, activation=activation, alpha=ALPHA, limit=LIMIT, out_float=out_float,
                               portable=portable)


# ---------------------------------------------------------------------------- against torch


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(8, 2, 96, 80), (64, 8, 64, 48), (16, 4, 70, 33)],
                         ids=["E8k2", "E64k8", "odd"])
def test_matches_a_dense_float32_reference(shape: tuple[int, int, int, int], activation: str, dtype: torch.dtype,
                                           portable: bool) -> None:
    """k=2 of 8 experts and k=8 of 64, uneven routing (an expert with more than one tile of
    64 rows, experts with none), intermediate sizes that are not multiples of 64 and an odd
    hidden size; biases with gpt-oss's activation, whose gate and up reach its clamps."""
    experts, k, hidden, inter = shape
    gen = torch.Generator().manual_seed(experts * 100 + hidden)
    gpt_oss = activation == "gpt_oss"
    weights = cast(random_experts(experts, hidden, inter, gen, bias=gpt_oss, scale=1.0 if gpt_oss else 0.1), dtype)
    x = torch.randn(80, hidden, generator=gen).to(dtype)
    ids, w = routing(80, experts, k, gen)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert counts.max() > 64 and (counts == 0).any()
    out = layer(weights, activation, portable=portable)(x, ids, w)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference(x, weights, ids, w, activation)
    scale = expected.abs().max().item()
    # bf16: the roundings of gate, up and the activation's steps (a few bf16 ulps of the largest terms).
    tol = 1e-2 * scale if dtype == torch.bfloat16 else 1e-5 * scale
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=0)


def test_bf16_bits_are_the_cpu_linear_ops_composed_summed_in_top_k_order() -> None:
    """Per (token, slot): InvariantLinear(gate_up), silu_mul, InvariantLinear(down) in float32;
    then per token the k weighted outputs added in float32 in top-k order from zero and
    rounded once to bf16: the same bits."""
    experts, k, hidden, inter, tokens = 8, 3, 128, 192, 20
    gen = torch.Generator().manual_seed(3)
    gate_up, down, _, _ = cast(random_experts(experts, hidden, inter, gen, bias=False), torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids, w = routing(tokens, experts, k, gen)
    gate_ups = [cpu_kernels.InvariantLinear(gate_up[e], None) for e in range(experts)]
    downs = [cpu_kernels.InvariantLinear(down[e], None, out_float=True) for e in range(experts)]
    acc = torch.zeros(tokens, hidden)
    for s in range(k):
        y = torch.cat([downs[e](cpu_kernels.silu_mul(gate_ups[e](x[t:t + 1])))
                       for t, e in enumerate(ids[:, s].tolist())])
        acc = acc + w[:, s:s + 1] * y
    moe = InvariantMoeExperts(gate_up, down)
    assert torch.equal(moe(x, ids, w), acc.bfloat16())
    exact = InvariantMoeExperts(gate_up, down, out_float=True)(x, ids, w)
    assert exact.dtype == torch.float32 and torch.equal(exact, acc)


def test_gpt_oss_matches_transformers_gpt_oss_experts() -> None:
    """transformers' GptOssExperts (interleaved gate/up, biases, alpha 1.702, limit 7) on random
    weights, through from_gpt_oss_layout: float32 within float32 rounding; bf16 within bf16
    rounding of transformers' float32, and closer to it on average than transformers' bf16."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config._experts_implementation = "eager"
    assert (config.swiglu_alpha, config.swiglu_limit) == (ALPHA, LIMIT)
    experts = GptOssExperts(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.7 if p.dim() == 3 else 1.0))
    x = torch.randn(40, 64, generator=gen)
    ids, w = routing(40, 8, 2, gen)
    w = w.bfloat16().float()   # the weights a bf16 router gives, for both dtypes
    weights = from_gpt_oss_layout(experts.gate_up_proj.data, experts.gate_up_proj_bias.data,
                                  experts.down_proj.data, experts.down_proj_bias.data)
    with torch.no_grad():
        expected = experts(x, ids, w)
        ours = layer(weights, "gpt_oss")(x, ids, w)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(ours, reference(x, weights, ids, w, "gpt_oss"), atol=1e-4, rtol=1e-5)
        experts.bfloat16()
        xb = x.bfloat16()
        theirs = experts(xb, ids, w.bfloat16()).float()
        weights = from_gpt_oss_layout(experts.gate_up_proj.data, experts.gate_up_proj_bias.data,
                                      experts.down_proj.data, experts.down_proj_bias.data)
        mine = layer(weights, "gpt_oss")(xb, ids, w)
    exact = reference(xb, weights, ids, w, "gpt_oss")   # float32 on the bf16 weights and input
    scale = exact.abs().max().item()
    torch.testing.assert_close(mine.float(), exact, atol=2e-2 * scale, rtol=0)
    assert (mine.float() - exact).abs().mean() <= (theirs - exact).abs().mean()


def test_silu_matches_transformers_mixtral_experts() -> None:
    """Mixtral's (and Qwen3-MoE's) stacked layout: gate_up_proj (E, 2I, H), gate rows first."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=64, intermediate_size=80, num_local_experts=8, num_experts_per_tok=2,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    experts = MixtralExperts(config)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        x = torch.randn(30, 64, generator=gen)
        ids, w = routing(30, 8, 2, gen)
        expected = experts(x, ids, w)
        ours = InvariantMoeExperts(experts.gate_up_proj.data, experts.down_proj.data)(x, ids, w)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- bits


def assert_tokens_invariant(moe: InvariantMoeExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
    """Each token's output alone equals its output in batches of many sizes, at other
    rows (shuffled) and in chunks: a prefill chunk, a decode step, a mixed batch."""
    alone = torch.cat([moe(x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(len(x))])
    for m in (2, 3, 7, 16, 33, 64, 65, len(x)):
        assert torch.equal(moe(x[:m], ids[:m], w[:m]), alone[:m]), f"tokens differ from alone at {m} tokens"
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(moe(x[perm], ids[perm], w[perm]), alone[perm]), "a token's result depends on its row"
    cuts = [0, 50, 51, 90, len(x)]
    chunks = [moe(x[a:b], ids[a:b], w[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(chunks), alone), "chunking changes a token's result"


@pytest.mark.parametrize("dtype,portable", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)],
                         ids=["bf16", "bf16-portable", "fp32"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_a_tokens_bits_do_not_depend_on_its_batch(activation: str, dtype: torch.dtype, portable: bool) -> None:
    experts, k, hidden, inter, tokens = 64, 8, 128, 96, 150
    gen = torch.Generator().manual_seed(21)
    weights = cast(random_experts(experts, hidden, inter, gen, bias=activation == "gpt_oss"), dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids, w = routing(tokens, experts, k, gen)
    assert torch.bincount(ids.flatten()).max() > 128   # experts past two tiles of rows
    assert_tokens_invariant(layer(weights, activation, portable=portable), x, ids, w)


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_the_threads(dtype: torch.dtype, tokens: int) -> None:
    """The items' width follows the thread count and any thread claims any item."""
    experts, k, hidden, inter = 16, 4, 256, 192
    gen = torch.Generator().manual_seed(tokens)
    weights = cast(random_experts(experts, hidden, inter, gen, bias=True), dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids, w = routing(tokens, experts, k, gen)
    moe = layer(weights, "gpt_oss")
    with torch_threads(1):
        one = moe(x, ids, w)
    for threads in (2, 3):
        with torch_threads(threads):
            assert torch.equal(moe(x, ids, w), one), f"{threads} threads"


def test_fast_kernel_and_portable_loops_agree() -> None:
    """The CPU's fastest bf16 kernel and the portable loops read the same packed weights and
    differ only in their order of additions inside each projection."""
    if cpu_kernels.linear_kernel() == "portable":
        pytest.skip("neither AMX-BF16 nor AVX-512 BF16 on this CPU")
    gen = torch.Generator().manual_seed(31)
    weights = cast(random_experts(32, 576, 256, gen, bias=False, scale=0.05), torch.bfloat16)
    x = torch.randn(24, 576, generator=gen).bfloat16()
    ids, w = routing(24, 32, 4, gen)
    fast, plain = InvariantMoeExperts(*weights, out_float=True), InvariantMoeExperts(*weights, out_float=True,
                                                                                       portable=True)
    assert torch.equal(fast.gate, plain.gate) and torch.equal(fast.down, plain.down)
    torch.testing.assert_close(fast(x, ids, w), plain(x, ids, w), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------- tensor parallelism, edges


@pytest.mark.parametrize("size", [2, 4])
def test_rank_shards_sum_to_the_whole_layer(size: int) -> None:
    """Each rank runs its slice of every expert's intermediate size (a local I); the sum of
    the ranks' partial outputs (the caller's all-reduce) is the whole layer's, biases once."""
    experts, k, hidden, inter = 8, 2, 64, 128
    gen = torch.Generator().manual_seed(size)
    weights = random_experts(experts, hidden, inter, gen, bias=True)
    x = torch.randn(12, hidden, generator=gen)
    ids, w = routing(12, experts, k, gen)
    whole = layer(weights, "gpt_oss")(x, ids, w)
    parts = [layer(shard_experts(weights, rank, size), "gpt_oss", out_float=True) for rank in range(size)]
    assert all(p.intermediate_size == inter // size for p in parts)
    torch.testing.assert_close(sum(p(x, ids, w) for p in parts), whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="split"):
        shard_experts(weights, 0, 3)


def test_no_tokens_and_float_weights_of_other_dtypes() -> None:
    gen = torch.Generator().manual_seed(41)
    weights = cast(random_experts(4, 32, 64, gen, bias=False), torch.bfloat16)
    moe = InvariantMoeExperts(*weights)
    assert moe(torch.zeros(0, 32).bfloat16(), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 32)
    x = torch.randn(3, 32, generator=gen).bfloat16()
    ids, w = routing(3, 4, 2, gen)
    assert torch.equal(moe(x, ids.int(), w.bfloat16()), moe(x, ids, w.bfloat16().float()))


def test_rejects_bad_routing_and_shapes() -> None:
    gen = torch.Generator().manual_seed(51)
    gate_up, down, _, _ = cast(random_experts(4, 32, 64, gen, bias=False), torch.bfloat16)
    moe = InvariantMoeExperts(gate_up, down)
    x = torch.randn(2, 32).bfloat16()
    w = torch.full((2, 2), 0.5)
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match="routed to expert"):
            moe(x, torch.tensor([[0, 1], [2, bad]]), w)
    with pytest.raises(RuntimeError, match="dtype"):
        moe(x.float(), torch.tensor([[0, 1], [2, 3]]), w)
    with pytest.raises(RuntimeError, match="topk_weights"):
        moe(x, torch.tensor([[0, 1], [2, 3]]), w[:, :1])
    with pytest.raises(ValueError, match="activation"):
        InvariantMoeExperts(gate_up, down, activation="gelu")
    with pytest.raises(ValueError, match="down"):
        InvariantMoeExperts(gate_up, down[:, :, :32])
