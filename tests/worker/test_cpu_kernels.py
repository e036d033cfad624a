"""The CPU's batch-invariant kernels, and every other op of the CPU path, one at a time.

Each op is checked two ways: against a torch reference within rounding, and
bit for bit against itself, a row computed alone vs. the same row inside
batches of many sizes, at many positions, and with 1 or 2 threads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.support.attention_cases import CPU_FLAGS, auto_bf16_form, named_forms, register_forms
from tests.support.invariance_driver import torch_threads
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.attention.backend import AttentionMetadata, InvariantCpuAttention, TorchPagedAttention, to_kernel_layout
from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache
from jitney.worker.layers.ops import TorchLayerOps, apply_rotary, rms_norm_torch
from jitney.worker.layers.rotary import rope_inv_freq
from jitney.worker.runner.sampler import greedy_logprobs, log_softmax_rows, row_logsumexp, row_sums, softmax_stats

DTYPES = [torch.bfloat16, torch.float32]
ROW_COUNTS = [1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 24, 25, 31, 32, 33, 64, 65, 130, 513]
CPU = torch.device("cpu")


def assert_rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """fn's row i over x[:m] equals fn over x[i:i+1] alone, for every m, and wherever the row sits."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(min(len(x), 70))])
    for m in ROW_COUNTS:
        if m > len(x):
            continue
        batch = fn(x[:m])
        k = min(m, len(alone))
        assert torch.equal(batch[:k], alone[:k]), f"rows differ from the same rows alone at {m} rows"
    m = min(len(x), 50)
    rolled = fn(torch.roll(x[:m], 7, dims=0))
    assert torch.equal(torch.roll(rolled, -7, dims=0), fn(x[:m])), "a row's result depends on its position"


# ---------------------------------------------------------------------------- linear


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 144), (144, 64), (576, 960), (1536, 576), (98, 100), (77, 70)])
def test_linear_matches_torch_and_every_row_is_batch_invariant(dtype: torch.dtype, shape: tuple[int, int],
                                                               portable: bool) -> None:
    """Both bf16 kernels (the CPU's fastest, and the portable loops), at in_features
    that are and are not multiples of 32 (and odd), row counts on both sides of the
    kernels' switches of unit width (ROW_COUNTS: 2/3 and 6/7 where the 64-column units
    split evenly between threads, 8/9 and 14/15 around the one-tile units, 12/13,
    16/17 and 24/25 for the 32-column units' blocks of 12) and ragged last row blocks."""
    k, n = shape
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(600, k, generator=gen).to(dtype)
    layer = cpu_kernels.InvariantLinear(weight, bias, portable=portable)
    expected = F.linear(x[:40].float(), weight.float(), bias.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(layer(x[:40]).float(), expected, atol=tol, rtol=tol)
    assert layer(x[:3]).dtype == dtype
    assert_rows_invariant(layer, x)


@pytest.mark.parametrize("shape", [(77, 70), (100, 98), (64, 144), (33, 16), (576, 200)])
def test_the_portable_bf16_linear_adds_each_outputs_products_in_k_order(shape: tuple[int, int]) -> None:
    """The portable kernel's bits (vectorised across columns where the CPU has AVX2) are
    its definition: each output's float32 products added in K order from zero, then the
    bias; odd K, ragged column tiles, 1-13 rows (each row-blocking of the AVX2 form)."""
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen)
    for with_bias in (True, False):
        layer = cpu_kernels.InvariantLinear(weight, bias if with_bias else None, out_float=True, portable=True)
        for m in (1, 2, 3, 4, 5, 9, 13):
            x = torch.randn(m, k, generator=gen).bfloat16()
            expected = torch.zeros(m, n)
            for j in range(k):  # separate multiply and add: the kernel's two roundings
                expected = expected + x[:, j:j + 1].float() * weight[:, j].float()
            if with_bias:
                expected = expected + bias
            assert torch.equal(layer(x), expected), (m, with_bias)


def test_bf16_linears_run_on_the_fastest_kernel_the_cpu_has() -> None:
    """No silent fallback: AMX-BF16 where the CPU has it, else AVX-512 BF16 where it has
    that, else the portable loops. The fast kernel reads the same packed weights as the
    portable loops, and its bits differ from theirs (its own order of additions)."""
    kernel = cpu_kernels.linear_kernel()
    expected = "amx" if "amx_bf16" in CPU_FLAGS else "avx512_bf16" if "avx512_bf16" in CPU_FLAGS else "portable"
    assert kernel == expected, f"bf16 linears run on {kernel} on a CPU with {expected}"
    if kernel == "portable":
        pytest.skip("neither AMX-BF16 nor AVX-512 BF16 on this CPU")
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(256, 576, generator=gen).bfloat16()
    x = torch.randn(40, 576, generator=gen).bfloat16()
    fast = cpu_kernels.InvariantLinear(weight, None, out_float=True)
    plain = cpu_kernels.InvariantLinear(weight, None, out_float=True, portable=True)
    assert torch.equal(fast.packed, plain.packed)   # one layout
    torch.testing.assert_close(fast(x), plain(x), atol=1e-3, rtol=1e-3)
    assert not torch.equal(fast(x), plain(x))


def test_bf16_linear_outputs_round_like_torch() -> None:
    """Each bf16 output is its float32 sum (+ bias) rounded as torch rounds (to
    nearest even): the kernel's own rounding, against its float output; NaN is
    written as convert.h writes it."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(150, 64, generator=gen).bfloat16()   # 150 columns: a ragged last group
    bias = torch.randn(150, generator=gen).bfloat16()
    x = torch.randn(37, 64, generator=gen).bfloat16()
    x[5, 3] = float("nan")
    rounded = cpu_kernels.InvariantLinear(weight, bias)(x)
    exact = cpu_kernels.InvariantLinear(weight, bias, out_float=True)(x)
    finite = torch.arange(len(x)) != 5
    assert torch.equal(rounded[finite].view(torch.int16), exact[finite].bfloat16().view(torch.int16))
    assert exact[5].isnan().all()
    assert (rounded[5].view(torch.int16) == 0x7FC0).all()   # convert.h's one quiet NaN, whatever the sign


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [3000, 960, 576])
def test_linear_bits_do_not_depend_on_threads(columns: int, dtype: torch.dtype) -> None:
    """The threads split the columns, and where a layer's 64-column units do not
    split evenly between them (47, 15 and 9 units here), the units' rows too
    (float32: its blocks of 32 rows): which thread computes an output, in which
    block of rows, changes no bit."""
    gen = torch.Generator().manual_seed(columns)
    weight = torch.randn(columns, 576, generator=gen).to(dtype)
    x = torch.randn(70, 576, generator=gen).to(dtype)
    layer = cpu_kernels.InvariantLinear(weight, None)
    with torch_threads(1):
        one = layer(x)
    for threads in (2, 3):
        with torch_threads(threads):
            assert torch.equal(layer(x), one), f"{threads} threads"


def test_linear_float_output_keeps_the_accumulator() -> None:
    weight = torch.randn(320, 64).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    head = cpu_kernels.InvariantLinear(weight, None, out_float=True)
    logits = head(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x.float(), weight.float()), atol=1e-3, rtol=1e-3)
    assert_rows_invariant(head, x)


def test_linear_rejects_mismatched_inputs() -> None:
    layer = cpu_kernels.InvariantLinear(torch.randn(32, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="dtype"):
        layer(torch.randn(2, 16))
    with pytest.raises(RuntimeError, match="in_features"):
        layer(torch.randn(2, 18).bfloat16())


def test_use_invariant_linears_swaps_every_linear() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    x = torch.randn(5, 16)
    expected = net(x)
    assert cpu_kernels.use_invariant_linears(net) == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in net.modules())
    torch.testing.assert_close(net(x), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- attention


def paged_problem(dtype: torch.dtype, heads: tuple[int, int, int], block: int, seq_lens: list[int],
                  query_lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 AttentionMetadata, list[list[int]]]:
    """Random caches with NaN in every slot no sequence owns, queries and their metadata."""
    nh, kvh, d = heads
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(s / block) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    k_cache = torch.full((num_blocks, block, kvh, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s, need in zip(seq_lens, blocks_needed):
        table, order = order[:need], order[need:]
        tables.append(table)
        for pos in range(s):
            slot = (table[pos // block], pos % block)
            k_cache[slot] = torch.randn(kvh, d, generator=gen).to(dtype)
            v_cache[slot] = torch.randn(kvh, d, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), nh, d, generator=gen).to(dtype)
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                   block_size=block, device=CPU)
    return query, k_cache, v_cache, meta, tables


def invariant_attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """InvariantCpuAttention over token-major caches ``k``, ``v`` (copied into the kernel's layout)."""
    backend = InvariantCpuAttention()
    return backend.attend(query, *to_kernel_layout(k, v), backend.prepare(meta), query.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,block", [((9, 3, 64), 16), ((4, 2, 16), 4), ((4, 4, 8), 16)])
def test_paged_attention_matches_torch(dtype: torch.dtype, heads: tuple[int, int, int], block: int) -> None:
    seq_lens, query_lens = [37, 1, 100, 130, 64, 5], [1, 1, 1, 20, 64, 5]
    query, k, v, meta, _ = paged_problem(dtype, heads, block, seq_lens, query_lens)
    out = invariant_attend(query, k, v, meta)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    clean_k, clean_v = torch.nan_to_num(k.float()), torch.nan_to_num(v.float())
    torch_ref = TorchPagedAttention()
    expected = torch_ref.attend(query.float(), clean_k, clean_v, torch_ref.prepare(meta), heads[2] ** -0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,block", [((4, 2, 16), 4), ((9, 3, 64), 16)])
def test_every_query_gets_the_bits_it_gets_alone_as_a_decode(dtype: torch.dtype, heads: tuple[int, int, int],
                                                              block: int) -> None:
    """Prefill chunks, decodes, any step composition: a query at position p of
    a sequence attends exactly as that sequence's decode at p would."""
    seq_lens, query_lens = [37, 1, 23, 50, 19], [1, 1, 9, 50, 3]
    query, k, v, meta, tables = paged_problem(dtype, heads, block, seq_lens, query_lens, seed=3)
    together = invariant_attend(query, k, v, meta)
    starts = meta.query_start_loc_host
    for i, s in enumerate(seq_lens):
        for t in range(starts[i], starts[i + 1]):
            pos = s - (starts[i + 1] - t)
            alone = AttentionMetadata.build(query_lens=[1], seq_lens=[pos + 1], block_tables=[tables[i]],
                                            block_size=block, device=CPU)
            assert torch.equal(invariant_attend(query[t:t + 1], k, v, alone)[0], together[t]), (i, t)
    with torch_threads(1):
        assert torch.equal(invariant_attend(query, k, v, meta), together)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 2, 64)])
@pytest.mark.parametrize("form", register_forms())
def test_the_register_forms_give_the_scalar_loops_bits(form: str, dtype: torch.dtype,
                                                       heads: tuple[int, int, int]) -> None:
    """16-token blocks with head_dim a multiple of 64 run in AVX-512 or AVX2 registers
    (where the CPU has them), partial blocks included; the runtime-sized scalar loops
    define the arithmetic. Decodes, prefill tiles, partial blocks, NaN in unowned slots."""
    seq_lens, query_lens = [1, 16, 17, 200, 33, 100, 31], [1, 16, 1, 1, 33, 40, 20]
    query, k, v, meta, _ = paged_problem(dtype, heads, 16, seq_lens, query_lens, seed=5)
    args = (query, *to_kernel_layout(k, v), meta.block_tables, meta.seq_lens, meta.query_start_loc)
    for scale in (heads[2] ** -0.5, 0.1234):
        fast = cpu_kernels.paged_attention(*args, scale, form)
        assert bool(torch.isfinite(fast).all())
        assert torch.equal(fast, cpu_kernels.paged_attention(*args, scale, "portable")), scale


def attention_kernels(dtype: torch.dtype) -> list[str]:
    """Every form paged_attention can run ``dtype`` in on this CPU (amx, avx512bf16: bfloat16 only)."""
    have = ["portable"] + register_forms()
    return have + named_forms() * (dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 2, 16)])
def test_many_decodes_attend_as_they_do_alone(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    """From 4 decodes a thread, a decode's kv heads are one work item (a step of a few
    decodes keeps one item a head): the bits do not change with it, in every form the
    CPU has, with 1 and 2 threads, beside a prefill chunk."""
    seq_lens = [1, 16, 17, 200, 33, 100, 31, 64, 5, 130, 48, 49, 90, 2, 77, 150, 120]
    query_lens = [1] * 16 + [30]
    query, k, v, meta, tables = paged_problem(dtype, heads, 16, seq_lens, query_lens, seed=11)
    kernel_k, kernel_v = to_kernel_layout(k, v)
    scale = heads[2] ** -0.5
    for kernel in attention_kernels(dtype):
        for threads in (1, 2):
            with torch_threads(threads):
                args = (query, kernel_k, kernel_v, meta.block_tables, meta.seq_lens, meta.query_start_loc)
                together = cpu_kernels.paged_attention(*args, scale, kernel)
                for i in range(16):   # each decode alone: one item a kv head
                    alone = AttentionMetadata.build(query_lens=[1], seq_lens=[seq_lens[i]], block_tables=[tables[i]],
                                                    block_size=16, device=CPU)
                    got = cpu_kernels.paged_attention(query[i:i + 1], kernel_k, kernel_v, alone.block_tables,
                                                      alone.seq_lens, alone.query_start_loc, scale, kernel)
                    assert torch.equal(got[0], together[i]), (kernel, threads, i)


def test_bf16_attention_runs_the_cpus_form_unless_one_is_named() -> None:
    """No silent fallback: the server's default for bfloat16 is the dot products' form on
    any CPU with AVX-512 BF16, else the AVX-512 registers' form (the scalar loops' bits),
    else the scalar loops. The tile unit's and the dot products' forms round the softmax's
    weights to bfloat16 before the values (their own bits): within a bfloat16 rounding of
    the scalar loops' answer, partial blocks and NaN in unowned slots included; a form the
    CPU lacks is refused."""
    kernel = cpu_kernels.attention_kernel()
    expected = auto_bf16_form()
    assert kernel == expected, f"bf16 attention runs in {kernel} on a CPU with {expected}"
    for heads in [(9, 3, 64), (8, 2, 128)]:
        seq_lens, query_lens = [1, 16, 17, 200, 33, 100, 31], [1, 16, 1, 1, 33, 40, 20]
        query, k, v, meta, _ = paged_problem(torch.bfloat16, heads, 16, seq_lens, query_lens, seed=5)
        args = (query, *to_kernel_layout(k, v), meta.block_tables, meta.seq_lens, meta.query_start_loc,
                heads[2] ** -0.5)
        plain = cpu_kernels.paged_attention(*args, "portable")
        for form in attention_kernels(torch.bfloat16):
            got = cpu_kernels.paged_attention(*args, form)
            assert bool(torch.isfinite(got).all()), form
            torch.testing.assert_close(got.float(), plain.float(), atol=2e-2, rtol=2e-2)
    missing = [form for form in ("avx512", "avx2", "avx512bf16", "amx") if form not in attention_kernels(torch.bfloat16)]
    for form in missing:
        with pytest.raises(RuntimeError, match=f"the {form} attention kernel needs"):
            cpu_kernels.paged_attention(*args, form)
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        cpu_kernels.paged_attention(query.float(), *to_kernel_layout(k.float(), v.float()), meta.block_tables,
                                    meta.seq_lens, meta.query_start_loc, 0.125, "amx")
    with pytest.raises(RuntimeError, match="must be auto, amx, avx512bf16, avx512, avx2 or portable"):
        cpu_kernels.paged_attention(*args, "fast")


@pytest.mark.skipif("avx512_bf16" not in CPU_FLAGS, reason="no AVX-512 BF16 on this CPU")
def test_vdpbf16ps_is_the_manuals_arithmetic() -> None:
    """The default bfloat16 attention's bits are the same on every CPU with AVX-512 BF16
    only if each one's vdpbf16ps computes what Intel's manual sets down: per lane, the
    high pair's product added and rounded to nearest even, then the low pair's (bfloat16
    products are exact in float32). Checked bit for bit on lanes whose exponents spread
    far enough that the other plausible orders (the low pair first, one rounding of the
    whole sum) give other bits on many of them."""
    gen = torch.Generator().manual_seed(7)
    n = 1 << 16

    def spread(*shape: int) -> torch.Tensor:   # normal numbers over 2^-12 .. 2^12
        return torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-12, 13, shape, generator=gen).float())

    acc, a, b = spread(n), spread(n, 2).bfloat16(), spread(n, 2).bfloat16()
    p = a.float() * b.float()   # exact
    manual = (acc + p[:, 1]) + p[:, 0]
    got = cpu_kernels.dot_bf16_pairs(acc, a, b)
    differ = int((got.view(torch.int32) != manual.view(torch.int32)).sum())
    assert differ == 0, f"vdpbf16ps differs from the manual's arithmetic on {differ} of {n} lanes"
    low_first = (acc + p[:, 0]) + p[:, 1]
    once = (acc.double() + p[:, 1].double() + p[:, 0].double()).float()
    for other in (low_first, once):
        assert int((other.view(torch.int32) != manual.view(torch.int32)).sum()) > n // 100


def test_the_process_form_is_what_auto_runs_and_a_missing_one_is_refused() -> None:
    """--cpu-attention: set_attention_kernel makes "auto" (the server's layers) run the
    named form, bit for bit, for bfloat16, and for float32 where the form takes it (amx,
    avx512bf16: float32 keeps its own fastest); "auto" restores the CPU's fastest; an unknown name or
    a form this CPU lacks is refused and leaves the setting as it was."""
    fastest, have = cpu_kernels.attention_kernel(), attention_kernels(torch.bfloat16)
    seq_lens, query_lens = [1, 40, 200], [1, 40, 3]
    problems = {dtype: paged_problem(dtype, (9, 3, 64), 16, seq_lens, query_lens, seed=3)
                for dtype in DTYPES}

    def run(dtype: torch.dtype, kernel: str) -> torch.Tensor:
        query, k, v, meta, _ = problems[dtype]
        return cpu_kernels.paged_attention(query, *to_kernel_layout(k, v), meta.block_tables, meta.seq_lens,
                                           meta.query_start_loc, 0.125, kernel)

    float32_auto = run(torch.float32, "auto")
    try:
        for form in have:
            cpu_kernels.set_attention_kernel(form)
            assert cpu_kernels.attention_kernel() == form
            assert torch.equal(run(torch.bfloat16, "auto"), run(torch.bfloat16, form)), form
            want32 = float32_auto if form in ("amx", "avx512bf16") else run(torch.float32, form)
            assert torch.equal(run(torch.float32, "auto"), want32), form
        cpu_kernels.set_attention_kernel("portable")
        with pytest.raises(RuntimeError, match="must be auto, amx, avx512bf16, avx512, avx2 or portable"):
            cpu_kernels.set_attention_kernel("fast")
        if "amx" not in have:
            with pytest.raises(RuntimeError, match="the amx attention kernel needs"):
                cpu_kernels.set_attention_kernel("amx")
        assert cpu_kernels.attention_kernel() == "portable"
    finally:
        cpu_kernels.set_attention_kernel("auto")
    assert cpu_kernels.attention_kernel() == fastest
    assert torch.equal(run(torch.bfloat16, "auto"), run(torch.bfloat16, fastest))


def test_paged_attention_rejects_bad_metadata() -> None:
    query, token_k, token_v, meta, _ = paged_problem(torch.float32, (4, 2, 16), 4, [9], [3])
    k, v = to_kernel_layout(token_k, token_v)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.paged_attention(query.bfloat16(), k, v, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.25)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_kernels.paged_attention(query, k, v, meta.block_tables[:, :1], meta.seq_lens,
                                    meta.query_start_loc, 0.25)
    with pytest.raises(RuntimeError, match="caches must be K"):   # token-major: not the kernel's layout
        cpu_kernels.paged_attention(query, token_k, token_v, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 0.25)
    with pytest.raises(RuntimeError, match="is not in the cache"):
        cpu_kernels.paged_attention(query, k, v, meta.block_tables + k.shape[0], meta.seq_lens,
                                    meta.query_start_loc, 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_layout_holds_each_kv_head_of_a_block_in_one_run(dtype: torch.dtype) -> None:
    """K (blocks, kvh, d / P, bs, P) with P = 4 bytes / element size, V (blocks, kvh, bs / P, d, P):
    what the invariant backend allocates and what its write_kv writes."""
    geometry = CacheGeometry(num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    pack = 2 if dtype == torch.bfloat16 else 1
    assert InvariantCpuAttention().block_shapes(geometry) == ((2, 8 // pack, 4, pack), (2, 4 // pack, 8, pack))
    assert TorchPagedAttention().block_shapes(geometry) == ((4, 2, 8), (4, 2, 8))
    if pack == 2:   # V's lanes pair keys: a bfloat16 cache's blocks hold whole pairs
        with pytest.raises(ValueError, match="block size 5 is not a multiple of 2"):
            InvariantCpuAttention().block_shapes(replace(geometry, block_size=5))
    cache = PagedKVCache(geometry, 5, CPU, InvariantCpuAttention().block_shapes(geometry))
    k, v = cache.layer(0)
    key, value = torch.randn(3, 2, 8).to(dtype), torch.randn(3, 2, 8).to(dtype)
    slots = torch.tensor([9, 0, 19])       # block 2 token 1, block 0 token 0, block 4 token 3
    meta = AttentionMetadata.build(query_lens=[1], seq_lens=[1], block_tables=[[0]], block_size=4, device=CPU)
    InvariantCpuAttention().write_kv(key, value, k, v, replace(meta, slot_mapping=slots))
    for t, (block, j) in enumerate([(2, 1), (0, 0), (4, 3)]):
        for h in range(2):
            assert torch.equal(v[block, h, j // pack, :, j % pack], value[t, h])
            for i in range(8):
                assert torch.equal(k[block, h, i // pack, j, i % pack], key[t, h, i])
    token_k, token_v = torch.zeros(5, 4, 2, 8, dtype=dtype), torch.zeros(5, 4, 2, 8, dtype=dtype)
    TorchPagedAttention().write_kv(key, value, token_k, token_v, replace(meta, slot_mapping=slots))
    assert all(torch.equal(a, b) for a, b in zip(to_kernel_layout(token_k, token_v), (k, v)))
    # A negative slot (a padding token) stores nothing, as rope_and_cache's.
    before = (k.clone(), v.clone())
    InvariantCpuAttention().write_kv(key * 2, value * 2, k, v, replace(meta, slot_mapping=torch.tensor([-1, 5, -1])))
    assert torch.equal(v[1, 0, 1 // pack, :, 1 % pack], value[1, 0] * 2)
    changed = (v != before[1]).any(dim=-2)   # (block, head, row pair, lane)
    assert changed.sum() == 2 and bool(changed[1, :, 1 // pack, 1 % pack].all())   # block 1 token 1, both heads
    changed_k = (k != before[0]).nonzero()   # (block, head, pair row, token, lane) of every changed value
    assert len(changed_k) > 0 and set(changed_k[:, 0].tolist()) == {1} and set(changed_k[:, 3].tolist()) == {1}


# ---------------------------------------------------------------------------- elementwise and norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [144, 1536])
def test_silu_mul_matches_torch_and_is_row_invariant(dtype: torch.dtype, width: int) -> None:
    gate_up = (torch.randn(600, 2 * width) * 3).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up).float(), expected, atol=tol, rtol=tol)
    assert_rows_invariant(cpu_kernels.silu_mul, gate_up)


@pytest.mark.parametrize("op", ["silu_mul", "gelu_mul"])
@pytest.mark.parametrize("width", [1, 7, 8, 13, 1536])
def test_gated_ops_register_form_gives_the_scalar_loops_bits(op: str, width: int) -> None:
    """float32 silu_mul / gelu_mul in AVX2 registers (where the CPU has them): the scalar
    loops' bits (``portable=True``), every element wherever it sits, the edges included."""
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(37, 2 * width, generator=gen) * torch.tensor([0.1, 3.0, 40.0]).repeat(13)[:37, None]
    edges = [0.0, -0.0, 1e-30, -1e-30, 1e-42, -88.0, 88.0, 1e20, -1e20, float("inf"), float("-inf"), float("nan")]
    flat = gate_up[:, :width].reshape(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:len(edges)]] = torch.tensor(edges)[:flat.numel()]
    gate_up[:, :width] = flat.view(37, width)
    fn = getattr(torch.ops.jitney_cpu, op)
    got, want = fn(gate_up), fn(gate_up, True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [144, 6912])
def test_gelu_mul_matches_torch_and_is_row_invariant(dtype: torch.dtype, width: int) -> None:
    gate_up = (torch.randn(200, 2 * width) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    exact = F.gelu(gate.double(), approximate="tanh")
    got_gelu = cpu_kernels.gelu_mul(torch.cat([gate, torch.ones_like(up)], dim=-1)).double()
    # The gelu alone is as close to float64's as torch's own (fp32: ~4e-7 here); bf16
    # rounds it once to the dtype, as torch does: within one rounding of the exact value.
    torch_err = (F.gelu(gate, approximate="tanh").double() - exact).abs().max().item()
    assert (got_gelu - exact).abs().max().item() <= max(2 * torch_err, 1e-6)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(cpu_kernels.gelu_mul(gate_up).float(),
                               (F.gelu(gate.float(), approximate="tanh") * up.float()), atol=tol, rtol=tol)
    assert_rows_invariant(cpu_kernels.gelu_mul, gate_up)
    edges = torch.tensor([[0.0, -0.0, 1e-8, -20.0, 20.0, 1e20, -1e20, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    torch.testing.assert_close(cpu_kernels.gelu_mul(edges).float(),
                               F.gelu(edges[:, :7].float(), approximate="tanh"), atol=1e-6, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 3072), (64, 256), (77, 192)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_silu_mul_gives_silu_mul_of_the_linear_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int],
                                                                   bias: bool) -> None:
    """gate_up and silu(gate) * up in one call (the layer stack's MLP): one pass on
    the AVX-512 BF16 kernel where the intermediate size is a multiple of 64 (1536,
    128 here; 96 takes the two calls), rows on both sides of its unit-width switch
    and row-block edges, 1-3 threads (the units' row slices), and the portable loops."""
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    layer = cpu_kernels.InvariantLinear((torch.randn(n, k, generator=gen) * 0.05).to(dtype),
                                        torch.randn(n, generator=gen).to(dtype) if bias else None)
    x = torch.randn(140, k, generator=gen).to(dtype)
    x[3, 5] = float("nan")   # a NaN row: silu_mul's NaN rule
    x[4] *= 300              # large gates: exp's underflow clamp
    fused = torch.ops.jitney_cpu.linear_silu_mul
    for portable in (False, True):
        args = (layer.packed, layer.bias, layer.in_features, layer.out_features)
        for rows in (1, 3, 6, 7, 8, 9, 12, 14, 15, 16, 33, 140):
            expected = cpu_kernels.silu_mul(torch.ops.jitney_cpu.linear(x[:rows], *args, False, portable))
            for threads in (1, 2, 3):
                with torch_threads(threads):
                    got = fused(x[:rows], *args, portable)
                assert got.dtype == dtype and got.shape == (rows, n // 2)
                assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), \
                    (portable, rows, threads)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        fused(x[:2], layer.packed, None, k, n - 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_torch_ops_of_the_cpu_path_are_row_invariant(dtype: torch.dtype, hidden: int) -> None:
    """RMSNorm (and its residual add), rotary inputs and rotation, the
    embedding: the torch ops the CPU path keeps give a row the same bits
    at every batch size."""
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(600, hidden, generator=gen).to(dtype)
    residual = torch.randn(600, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ops = TorchLayerOps(rope_inv_freq(64, 10000.0, None))
    assert_rows_invariant(lambda a: rms_norm_torch(a, weight, 1e-5), x)
    both = torch.cat((x, residual), dim=-1)
    assert_rows_invariant(lambda a: torch.cat(ops.add_rms_norm(a[:, :hidden], a[:, hidden:], weight, 1e-5), -1), both)
    positions = torch.randint(0, 8000, (600,), generator=gen)
    assert_rows_invariant(lambda p: torch.cat(ops.rope_inputs(p, dtype), dim=-1), positions)
    heads = torch.randn(600, 9, 64, generator=gen).to(dtype)
    cos, sin = ops.rope_inputs(positions, dtype)
    rows = torch.cat((heads.flatten(1), cos, sin), dim=-1)
    assert_rows_invariant(lambda r: apply_rotary(r[:, :576].view(-1, 9, 64), r[:, 576:640], r[:, 640:]).flatten(1),
                          rows)
    table = torch.randn(320, hidden, generator=gen).to(dtype)
    assert_rows_invariant(lambda ids: F.embedding(ids, table), torch.randint(0, 320, (600,), generator=gen))


@pytest.mark.parametrize("vocab", [320, 49152])
def test_logprob_reductions_are_row_invariant(vocab: int) -> None:
    # Against torch the check is closeness, not bits: torch sums the 49152 exps in an order
    # set by its vector width, ours in a fixed one, and the two float32 sums differ by
    # ~1e-5 in the log (1.3e-5 with AVX2's 8 lanes on this seed, past assert_close's
    # default 1e-5); sqrt(49152) * 2^-24 * |lse ~ 15| bounds the usual gap near 2e-4.
    logits = torch.randn(70, vocab, generator=torch.Generator().manual_seed(0)) * 4
    assert_rows_invariant(row_sums, logits.exp())
    assert_rows_invariant(row_logsumexp, logits)
    tokens = logits.argmax(dim=-1)
    lp = lambda rows: greedy_logprobs(rows)[1]  # noqa: E731
    assert_rows_invariant(lp, logits)
    near = {"atol": 1e-4, "rtol": 1e-5}
    torch.testing.assert_close(lp(logits), logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1), **near)
    assert_rows_invariant(log_softmax_rows, logits)
    torch.testing.assert_close(log_softmax_rows(logits), logits.log_softmax(-1), **near)


@pytest.mark.parametrize("vocab", [1, 17, 64, 100, 320, 49152])
def test_softmax_stats_match_numpy_and_torch_and_their_scalar_form(vocab: int) -> None:
    """``row_softmax_stats``: numpy's first argmax, the exact maximum, and log(sum(exp(x - max)))
    within float32 rounding of torch's; the AVX-512 form gives the scalar loops' bits."""
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(9, vocab, generator=gen) * 4).to(torch.bfloat16).float()   # bf16 values: ties occur
    x[1] = x[1, 0]                  # a row of one value: the first index
    if vocab > 5:
        x[2, 5] = x[2].max() + 1    # one clear maximum
        x[3, -1] = x[3].max() + 1   # the maximum in the tail
    tokens, top, log_total = softmax_stats(x)
    assert tokens.tolist() == x.numpy().argmax(axis=-1).tolist()
    assert torch.equal(top.squeeze(-1), x.amax(dim=-1))
    torch.testing.assert_close(log_total, torch.logsumexp(x, dim=-1) - x.amax(dim=-1), rtol=1e-5, atol=1e-5)
    portable = torch.ops.jitney_cpu.row_softmax_stats(x, True)
    for got, want in zip(torch.ops.jitney_cpu.row_softmax_stats(x), portable):
        assert torch.equal(got, want)
    assert torch.equal(greedy_logprobs(x)[1], (top.squeeze(-1) - top.squeeze(-1)) - log_total)


def test_softmax_stats_of_rows_without_a_finite_maximum() -> None:
    """NaN counts as the maximum (the first NaN, as numpy's argmax); a row whose maximum is
    NaN or infinite gets NaN; a finite row beside them is untouched. Both forms agree."""
    x = torch.zeros(5, 70)
    x[0, 3] = x[0, 40] = float("nan")
    x[1, 66] = float("inf")
    x[2] = float("-inf")
    x[3, 69] = float("nan")          # in the tail of the 64-wide body
    x[4, 10] = 2.0
    for portable in (False, True):
        tokens, top, log_total = torch.ops.jitney_cpu.row_softmax_stats(x, portable)
        assert tokens.tolist() == [3, 66, 0, 69, 10]
        assert math.isnan(top[0]) and top[1] == math.inf and top[2] == -math.inf and top[4] == 2.0
        assert all(math.isnan(v) for v in log_total[:4].tolist())
        assert log_total[4].item() == pytest.approx(math.log(1 + 69 * math.exp(-2)), rel=1e-6)
