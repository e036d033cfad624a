"""Sliding window, soft cap and sinks on every attention backend.

Each backend against a dense float32 reference (tests/support/attention_cases.py,
whose mask is transformers' own mask function); the CPU kernel's bits
batch-invariant, and the same on its AVX-512 and scalar paths, with each
feature on; the blocks before a window never read (their table entries point
at a block of NaNs, or past the cache); and with every feature off, the bits
of a call that names none. Triton runs under the interpreter where there is
no CUDA (tiny sizes: it runs every program in numpy).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support.triton_support import DEVICE, interpret_when_no_cuda, interpret_without_cuda, skip_unless_interpreted

interpret_when_no_cuda()   # before transformers' masking_utils (the reference's mask) imports Triton

from tests.support.attention_cases import (PagedCase, attend_case, attention_form, dtype_forms, named_forms, register_forms,  # noqa: E402
                                           paged_case, poison_early_blocks, random_sinks, reference_attention,
                                           visible)
from tests.support.invariance_driver import torch_threads  # noqa: E402
from jitney.worker.attention.backend import InvariantCpuAttention, TorchPagedAttention, to_kernel_layout  # noqa: E402
from jitney.worker.kernels.cpu import ops as cpu_kernels  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# name -> (window, softcap, sinks on): windows shorter than a block, across blocks (not a
# multiple of the block size), of one key, and longer than every context.
FEATURES = {
    "window5": (5, None, False),
    "window21": (21, None, False),
    "window1": (1, None, False),
    "window_long": (1000, None, False),
    "softcap": (None, 7.0, False),
    "sinks": (None, None, True),
    "all": (13, 5.0, True),
}
# Decodes first (mid-block, at position 0, on a block's last slot), then a later chunk, a
# first chunk of a whole block multiple, a short later chunk and a whole short prompt.
SEQ_LENS, QUERY_LENS = [37, 1, 64, 130, 64, 50, 23], [1, 1, 1, 20, 64, 5, 23]
GEOMETRIES = [((4, 2, 16), 4), ((9, 3, 64), 16)]   # ((heads, kv heads, head_dim), block size): GQA 2 and 3


def features(name: str, num_heads: int) -> dict[str, Any]:
    window, softcap, sinks = FEATURES[name]
    return {"window": window, "softcap": softcap, "sinks": random_sinks(num_heads) if sinks else None}


def scale_of(head_dim: int) -> float:
    """Scores of a few units (q, k ~ N(0, 1)), so that the soft caps bite."""
    return 3.0 * head_dim ** -0.5


def windowed_case(dtype: torch.dtype, heads: tuple[int, int, int], block: int, feats: dict[str, Any], *,
                  fill: float = float("nan"), seed: int = 0, seq_lens: list[int] = SEQ_LENS,
                  query_lens: list[int] = QUERY_LENS) -> PagedCase:
    """A mixed batch; with a window, the blocks before it point at a block of NaNs."""
    case = paged_case(dtype, heads, block, seq_lens, query_lens, seed=seed, fill=fill)
    return case if feats["window"] is None else poison_early_blocks(case, feats["window"])


# The torch path reads padding slots (masked, but NaN * 0 is NaN): its unowned slots are 0.
CPU_BACKENDS = {"torch": (TorchPagedAttention, 0.0), "invariant": (InvariantCpuAttention, float("nan"))}


class _Layer(torch.nn.Module):
    """What transformers' eager attention functions read of an attention layer."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.num_key_value_groups, self.head_dim, self.sinks = 2, 16, sinks


def test_the_reference_is_transformers_attention() -> None:
    """The reference's mask is transformers' sliding window (the docstring's example), its
    soft cap Gemma 2's eager attention and its sinks gpt-oss's."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention

    assert visible(torch.arange(5), torch.arange(5), 3).int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    case = paged_case(torch.float32, (4, 2, 16), 4, [11], [11], seed=2)   # one prompt: all its context
    q, k, v = case.query.transpose(0, 1)[None], case.keys[0].transpose(0, 1)[None], case.values[0].transpose(0, 1)[None]
    positions = torch.arange(11)
    additive = torch.zeros(1, 1, 11, 11).masked_fill(~visible(positions, positions, 4), float("-inf"))
    sinks = random_sinks(4, seed=1)
    module = _Layer(sinks).eval()
    scale = scale_of(16)
    capped, _ = gemma2_attention(module, q, k, v, additive, scaling=scale, softcap=7.0)
    torch.testing.assert_close(reference_attention(case, scale, window=4, softcap=7.0), capped[0])
    sunk, _ = gpt_oss_attention(module, q, k, v, additive, scaling=scale)
    torch.testing.assert_close(reference_attention(case, scale, window=4, sinks=sinks), sunk[0])


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("heads,block", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
def test_cpu_backends_match_the_reference(backend: str, dtype: torch.dtype, heads: tuple[int, int, int], block: int,
                                          feature: str) -> None:
    cls, fill = CPU_BACKENDS[backend]
    feats = features(feature, heads[0])
    case = windowed_case(dtype, heads, block, feats, fill=fill)
    out = attend_case(cls(), case, scale_of(heads[2]), **feats)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    want = reference_attention(case, scale_of(heads[2]), **feats)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("form", named_forms())
def test_named_cpu_forms_match_the_reference(form: str, feature: str) -> None:
    """The forms with bits of their own, named, on bfloat16 16-token blocks of head_dim 64
    and 128: within bfloat16's tolerance of the reference, every feature on, and (past
    one key a token) not the scalar loops' bits: the named form ran."""
    for heads in [(9, 3, 64), (8, 2, 128)]:
        feats = features(feature, heads[0])
        case = windowed_case(torch.bfloat16, heads, 16, feats, fill=float("nan"))
        with attention_form(form):
            out = attend_case(InvariantCpuAttention(), case, scale_of(heads[2]), **feats)
        assert bool(torch.isfinite(out).all())
        if feature != "window1":   # one key a token: every form gives its value, exactly
            with attention_form("portable"):
                loops = attend_case(InvariantCpuAttention(), case, scale_of(heads[2]), **feats)
            assert not torch.equal(out, loops)
        want = reference_attention(case, scale_of(heads[2]), **feats)
        torch.testing.assert_close(out.float(), want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def test_the_features_change_the_answer() -> None:
    """Each feature is honoured, not ignored: the answer moves from the plain one."""
    case = paged_case(torch.float32, (4, 2, 16), 4, SEQ_LENS, QUERY_LENS, fill=0.0)
    for backend in (TorchPagedAttention(), InvariantCpuAttention()):
        plain = attend_case(backend, case, scale_of(16))
        for name in ("window21", "softcap", "sinks"):
            assert (attend_case(backend, case, scale_of(16), **features(name, 4)) - plain).abs().max() > 1e-2, name


def decode_alone(case: PagedCase, seq: int, pos: int, feats: dict[str, Any]) -> torch.Tensor:
    """The CPU kernel's answer for the query token of sequence ``seq`` at ``pos``, as that sequence's decode."""
    token = sum(case.query_lens[:seq]) + pos - (case.seq_lens[seq] - case.query_lens[seq])
    alone = PagedCase(case.query[token:token + 1], case.k_cache, case.v_cache, [], [], [case.tables[seq]], [1],
                      [pos + 1], case.block_size)
    return attend_case(InvariantCpuAttention(), alone, scale_of(case.query.shape[2]), **feats)[0]


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("heads,block", GEOMETRIES + [((8, 2, 128), 16)])
@pytest.mark.parametrize("dtype,form", dtype_forms())
def test_the_cpu_kernel_gives_a_token_its_decode_bits(dtype: torch.dtype, form: str, heads: tuple[int, int, int],
                                                       block: int, feature: str) -> None:
    """Within a prefill chunk or batched with others, a token attends exactly as its
    sequence's decode at its position; the same bits with 1 and 2 threads, and with
    each prefill split into two chunks of other calls; in every form the CPU has."""
    with attention_form(form):
        decode_bits_hold(dtype, heads, block, feature)


def decode_bits_hold(dtype: torch.dtype, heads: tuple[int, int, int], block: int, feature: str) -> None:
    feats = features(feature, heads[0])
    case = windowed_case(dtype, heads, block, feats, seed=3)
    scale = scale_of(heads[2])
    together = attend_case(InvariantCpuAttention(), case, scale, **feats)
    start = 0
    for i, (qlen, slen) in enumerate(zip(case.query_lens, case.seq_lens)):
        for t in range(qlen):
            assert torch.equal(decode_alone(case, i, slen - qlen + t, feats), together[start + t]), (i, t)
        if qlen > 1:   # [slen - qlen, split) then [split, slen), each in its own call
            split = slen - qlen // 2
            head = PagedCase(case.query[start:start + qlen - qlen // 2], case.k_cache, case.v_cache, [], [],
                             [case.tables[i]], [qlen - qlen // 2], [split], case.block_size)
            tail = PagedCase(case.query[start + qlen - qlen // 2:start + qlen], case.k_cache, case.v_cache, [], [],
                             [case.tables[i]], [qlen // 2], [slen], case.block_size)
            chunks = torch.cat([attend_case(InvariantCpuAttention(), c, scale, **feats) for c in (head, tail)])
            assert torch.equal(chunks, together[start:start + qlen]), i
        start += qlen
    with torch_threads(1):
        assert torch.equal(attend_case(InvariantCpuAttention(), case, scale, **feats), together)
    with torch_threads(2):
        assert torch.equal(attend_case(InvariantCpuAttention(), case, scale, **feats), together)


@pytest.mark.parametrize("dtype,form", dtype_forms())
def test_many_decodes_attend_as_they_do_alone(dtype: torch.dtype, form: str) -> None:
    """From 4 decodes a thread a decode's kv heads are one work item: the same bits, with
    every feature on, beside a prefill chunk, with 1 and 2 threads."""
    feats = features("all", 9)
    seq_lens = [1, 16, 17, 200, 33, 100, 31, 64, 5, 130, 48, 49, 90, 2, 77, 150, 120]
    query_lens = [1] * 16 + [30]
    case = windowed_case(dtype, (9, 3, 64), 16, feats, seed=11, seq_lens=seq_lens, query_lens=query_lens)
    for threads in (1, 2):
        with torch_threads(threads), attention_form(form):
            together = attend_case(InvariantCpuAttention(), case, scale_of(64), **feats)
            for i in range(16):
                assert torch.equal(decode_alone(case, i, seq_lens[i] - 1, feats), together[i]), (threads, i)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (16, 2, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", register_forms())
def test_the_register_forms_give_the_scalar_loops_bits(form: str, dtype: torch.dtype, heads: tuple[int, int, int],
                                                       feature: str) -> None:
    """16-token blocks with head_dim a multiple of 64 in each register form the CPU has
    against the runtime-sized scalar loops, with windows starting inside blocks."""
    feats = features(feature, heads[0])
    seq_lens, query_lens = [1, 16, 17, 200, 33, 100, 31], [1, 16, 1, 1, 33, 40, 20]
    case = windowed_case(dtype, heads, 16, feats, seed=5, seq_lens=seq_lens, query_lens=query_lens)
    meta = case.meta()
    args = (case.query, *to_kernel_layout(case.k_cache, case.v_cache), meta.block_tables, meta.seq_lens,
            meta.query_start_loc, scale_of(heads[2]))
    fast = cpu_kernels.paged_attention(*args, form, **feats)
    assert bool(torch.isfinite(fast).all())
    assert torch.equal(fast, cpu_kernels.paged_attention(*args, "portable", **feats))


@pytest.mark.parametrize("poison", ["nan_block", "past_the_cache"])
@pytest.mark.parametrize("heads,block", GEOMETRIES)
@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
def test_blocks_before_the_window_are_not_read(backend: str, heads: tuple[int, int, int], block: int,
                                               poison: str) -> None:
    """The table entries of each sequence's blocks wholly before its first query's
    window point at a block of NaNs, or at no block at all: the answer is unchanged
    (the CPU kernel's to the bit)."""
    cls, fill = CPU_BACKENDS[backend]
    feats = features("all", heads[0])
    clean = paged_case(torch.float32, heads, block, SEQ_LENS, QUERY_LENS, seed=7, fill=fill)
    block_id = None if poison == "nan_block" else clean.k_cache.shape[0] + 1000
    poisoned = poison_early_blocks(clean, feats["window"], block_id=block_id)
    assert sum(t != c for tp, tc in zip(poisoned.tables, clean.tables) for t, c in zip(tp, tc)) >= 10
    out = attend_case(cls(), poisoned, scale_of(heads[2]), **feats)
    torch.testing.assert_close(out, reference_attention(clean, scale_of(heads[2]), **feats), atol=2e-5, rtol=2e-5)
    if backend == "invariant":
        assert torch.equal(out, attend_case(cls(), clean, scale_of(heads[2]), **feats))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
def test_features_off_keep_the_plain_bits(backend: str, dtype: torch.dtype) -> None:
    """None for every feature is the call without them; for the CPU kernel also the op
    called with its old arguments, a window longer than every context and -inf sinks."""
    cls, fill = CPU_BACKENDS[backend]
    case = paged_case(dtype, (9, 3, 64), 16, SEQ_LENS, QUERY_LENS, seed=9, fill=fill)
    plain = attend_case(cls(), case, 0.125)
    assert torch.equal(attend_case(cls(), case, 0.125, window=None, softcap=None, sinks=None), plain)
    if backend == "invariant":
        meta = case.meta()
        old = torch.ops.jitney_cpu.paged_attention(case.query, *to_kernel_layout(case.k_cache, case.v_cache),
                                                   meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
        assert torch.equal(old, plain)
        assert torch.equal(attend_case(cls(), case, 0.125, window=max(SEQ_LENS)), plain)
        assert torch.equal(attend_case(cls(), case, 0.125, sinks=torch.full((9,), float("-inf"))), plain)


BAD_FEATURES: list[tuple[dict[str, Any], str]] = [
    ({"window": 0}, "window"), ({"window": -3}, "window"), ({"window": 2.5}, "window"), ({"window": True}, "window"),
    ({"softcap": 0.0}, "softcap"), ({"softcap": -1.0}, "softcap"), ({"softcap": float("inf")}, "softcap"),
    ({"softcap": float("nan")}, "softcap"), ({"sinks": torch.zeros(3)}, "sinks"),
    ({"sinks": torch.zeros(4, dtype=torch.float64)}, "sinks"), ({"sinks": torch.zeros(4, 1)}, "sinks"),
]


@pytest.mark.parametrize("bad,match", BAD_FEATURES)
@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
def test_features_no_backend_can_honour_are_refused(backend: str, bad: dict[str, Any], match: str) -> None:
    cls, fill = CPU_BACKENDS[backend]
    case = paged_case(torch.float32, (4, 2, 16), 4, [9, 5], [1, 5], fill=fill)
    with pytest.raises(ValueError, match=match):
        attend_case(cls(), case, 0.25, **bad)


def test_the_cpu_op_checks_its_features_itself() -> None:
    """The op, called past the Python checks (the layer stack calls it from C++), refuses them too."""
    case = paged_case(torch.float32, (4, 2, 16), 4, [9, 5], [1, 5])
    meta = case.meta()
    args = (case.query, *to_kernel_layout(case.k_cache, case.v_cache), meta.block_tables, meta.seq_lens,
            meta.query_start_loc, 0.25, False)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"window": 0}, "window"), ({"softcap": -2.0}, "softcap"), ({"sinks": torch.zeros(3)}, "sinks"),
        ({"sinks": torch.zeros(4).double()}, "sinks"),
        ({"sinks": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, "sinks")]
    for kwargs, match in refused:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.jitney_cpu.paged_attention(*args, **kwargs)


# ---------------------------------------------------------------------------- Triton

TRITON_FEATURES = ["window5", "window21", "softcap", "sinks", "all"]
# One more decode, long, with a window of 200: it walks masked, unmasked and masked trips of 64 keys.
TRITON_SEQ_LENS, TRITON_QUERY_LENS = [37, 1, 300, 70, 50, 23], [1, 1, 1, 20, 5, 23]


@pytest.fixture(scope="module")
def triton_attention() -> ModuleType:
    """jitney.worker.attention.triton, interpreted where there is no CUDA (skips without Triton)."""
    triton = interpret_without_cuda()
    from jitney.worker.attention import triton as module

    skip_unless_interpreted(triton)
    return module


def triton_case(dtype: torch.dtype, block: int, feats: dict[str, Any], seed: int = 0) -> PagedCase:
    return windowed_case(dtype, (6, 2, 16), block, feats, seed=seed, seq_lens=TRITON_SEQ_LENS,
                         query_lens=TRITON_QUERY_LENS).to(DEVICE)


def device_features(feats: dict[str, Any]) -> dict[str, Any]:
    return {**feats, "sinks": None if feats["sinks"] is None else feats["sinks"].to(DEVICE)}


@pytest.mark.parametrize("feature", TRITON_FEATURES + ["window200"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [4, 16])
def test_triton_matches_the_reference(triton_attention: ModuleType, block: int, dtype: torch.dtype,
                                      feature: str) -> None:
    """Mixed batches, GQA 3, windows before the walk's first trip of 64 keys; NaNs in every
    unowned slot and in the blocks before each window."""
    feats = {"window": 200, "softcap": None, "sinks": None} if feature == "window200" else features(feature, 6)
    case = triton_case(dtype, block, feats)
    out = attend_case(triton_attention.TritonPagedAttention(), case, scale_of(16), **device_features(feats))
    want = reference_attention(case, scale_of(16), **feats)
    torch.testing.assert_close(out.float().cpu(), want, atol=TOL[dtype], rtol=0)


def test_triton_tile_mapped_launch_with_features(triton_attention: ModuleType) -> None:
    """The graph-safe launch over a tile map gives the per-sequence launch's answer."""
    from jitney.worker.runner.input_batch import tile_map

    host_feats = features("all", 6)
    feats = device_features(host_feats)
    case = triton_case(torch.float32, 4, feats, seed=4)
    meta = case.meta(DEVICE)
    block_q = triton_attention.prefill_block_q(6, 2)
    seqs, idx = tile_map(case.query_lens, block_q, num_tiles=sum(-(-n // block_q) for n in case.query_lens) + 2)
    tiles = (torch.tensor(seqs, device=DEVICE), torch.tensor(idx, device=DEVICE))
    out = triton_attention.paged_attention(case.query, case.k_cache, case.v_cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, scale_of(16), 1, tiles=tiles, **feats)
    want = reference_attention(case, scale_of(16), **host_feats)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=0)


def test_triton_batch_invariant_decodes_keep_their_bits(triton_attention: ModuleType) -> None:
    """With the prefill's tile height (--batch-invariant), a prefill token attends as its decode."""
    feats = device_features(features("all", 6))
    case = triton_case(torch.float32, 4, feats, seed=6)
    backend = triton_attention.TritonPagedAttention(batch_invariant=True)
    together = attend_case(backend, case, scale_of(16), **feats)
    seq, start = 3, sum(case.query_lens[:3])   # the 20-token chunk
    for t in range(case.query_lens[seq]):
        pos = case.seq_lens[seq] - case.query_lens[seq] + t
        alone = PagedCase(case.query[start + t:start + t + 1], case.k_cache, case.v_cache, [], [], [case.tables[seq]],
                          [1], [pos + 1], case.block_size)
        assert torch.equal(attend_case(backend, alone, scale_of(16), **feats)[0], together[start + t]), t


def test_triton_features_off_keep_the_plain_bits(triton_attention: ModuleType) -> None:
    case = triton_case(torch.float32, 16, features("softcap", 6))
    backend = triton_attention.TritonPagedAttention()
    plain = attend_case(backend, case, 0.25)
    assert torch.equal(attend_case(backend, case, 0.25, window=None, softcap=None, sinks=None), plain)


@pytest.mark.parametrize("bad,match", BAD_FEATURES)
def test_triton_refuses_features_it_cannot_honour(triton_attention: ModuleType, bad: dict[str, Any],
                                                  match: str) -> None:
    case = paged_case(torch.float32, (4, 2, 16), 4, [9, 5], [1, 5]).to(DEVICE)
    bad = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in bad.items()}
    with pytest.raises(ValueError, match=match):
        attend_case(triton_attention.TritonPagedAttention(), case, 0.25, **bad)
