"""The Triton kernels against plain torch references.

Without CUDA they run under the Triton interpreter on CPU tensors (the
interpreter is chosen when a kernel is decorated, so ``TRITON_INTERPRET`` is
set before the kernel modules are first imported; nothing imported earlier in
a test session imports them). With CUDA the same cases run compiled on the
GPU. Sizes are tiny: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from tests.support.triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker.runner.input_batch import tile_map  # noqa: E402
from jitney.worker.attention.triton import paged_attention, prefill_block_q  # noqa: E402
from jitney.worker.kernels.triton.cache import write_kv_cache  # noqa: E402

skip_unless_interpreted(triton)
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], scale: float,
) -> torch.Tensor:
    """Per sequence: gather its keys by block table, causal softmax in float32."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // kvh
    out, start = [], 0
    for qlen, slen, table in zip(query_lens, seq_lens, tables):
        slots = [table[p // bs] * bs + p % bs for p in range(slen)]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # (L, nh, d)
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        q = query[start : start + qlen].float()  # (q, nh, d)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(slen - qlen, slen)[:, None]
        scores = scores.masked_fill(torch.arange(slen)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += qlen
    return torch.cat(out)


def ragged_case(
    block_size: int, kvh: int, group: int, head_dim: int, dtype: torch.dtype, query_lens: list[int], seq_lens: list[int]
) -> dict[str, object]:
    """Random cache with scattered (non-contiguous) block tables; query as a strided slice."""
    g = torch.Generator().manual_seed(block_size * 1000 + group * 10 + len(query_lens))
    tables, num_blocks = [], sum(-(-s // block_size) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    width = max(map(len, tables)) + 1  # one column of padding too

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    nh, total = kvh * group, sum(query_lens)
    qkv = rand(total, nh + 2 * kvh, head_dim)  # the query is a slice of it: row stride != nh * d
    return {
        "query": qkv[:, :nh],
        "k_cache": rand(num_blocks, block_size, kvh, head_dim),
        "v_cache": rand(num_blocks, block_size, kvh, head_dim),
        "query_start_loc": torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=DEVICE),
        "seq_lens": torch.tensor(seq_lens, device=DEVICE),
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE),
        "tables": tables, "query_lens": query_lens, "seq_lens_list": seq_lens,
    }


# (block_size, kv heads, GQA group, head_dim, dtype)
GEOMETRIES = [
    (16, 2, 1, 64, torch.float32),
    (32, 1, 3, 128, torch.float16),
    (16, 2, 4, 128, torch.bfloat16),
    (32, 2, 3, 64, torch.float32),
    (16, 1, 4, 64, torch.float16),
]
# Decodes first (one crossing into a new block, one at position 0), then a
# first prefill chunk and a later chunk that starts mid-block.
MIXED = ([1, 1, 1, 7, 21], [17, 33, 1, 7, 40])
DECODES = ([1, 1, 1], [16, 35, 64])


@pytest.mark.parametrize("batch", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "bs{}-kvh{}-g{}-d{}-{}".format(*g[:4], str(g[4])[6:]))
def test_paged_attention_matches_reference(geometry: tuple, batch: tuple[list[int], list[int]]) -> None:
    block_size, kvh, group, head_dim, dtype = geometry
    case = ragged_case(block_size, kvh, group, head_dim, dtype, *batch)
    scale = head_dim**-0.5
    got = paged_attention(
        case["query"], case["k_cache"], case["v_cache"], case["query_start_loc"], case["seq_lens"],
        case["block_tables"], scale, max_query_len=max(batch[0]),
    )
    want = reference_attention(
        case["query"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu(),
        case["query_lens"], case["seq_lens_list"], case["tables"], scale,
    )
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL[dtype], rtol=0)


# Mixed steps as a captured graph sees them: padding rows (no tokens) after the
# real ones, a prefill longer than one tile, and room for more tiles than used.
TILED = ([1, 1, 70, 3, 0, 0], [20, 9, 70, 40, 0, 0])


@pytest.mark.parametrize("geometry", GEOMETRIES[:3], ids=lambda g: "bs{}-kvh{}-g{}-d{}-{}".format(*g[:4], str(g[4])[6:]))
def test_tile_mapped_launch_matches_reference(geometry: tuple) -> None:
    """The graph-safe launch over a tile map gives the per-sequence launch's answer."""
    block_size, kvh, group, head_dim, dtype = geometry
    query_lens, seq_lens = TILED
    case = ragged_case(block_size, kvh, group, head_dim, dtype, query_lens, [max(s, 1) for s in seq_lens])
    case["seq_lens"][len(seq_lens) - 2:] = 0        # padding rows: no keys
    block_q = prefill_block_q(kvh * group, kvh)
    seqs, idx = tile_map(query_lens, block_q, num_tiles=sum(-(-n // block_q) for n in query_lens) + 5)
    assert list(seqs).count(2) == -(-70 // block_q) and seqs[-1] == -1
    tiles = (torch.tensor(seqs, device=DEVICE), torch.tensor(idx, device=DEVICE))
    scale = head_dim**-0.5
    got = paged_attention(case["query"], case["k_cache"], case["v_cache"], case["query_start_loc"], case["seq_lens"],
                          case["block_tables"].to(torch.int32), scale, max_query_len=1, tiles=tiles)
    want = reference_attention(case["query"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu(),
                               query_lens[:4], seq_lens[:4], case["tables"][:4], scale)
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL[dtype], rtol=0)
    with pytest.raises(ValueError, match="exceed"):
        tile_map(query_lens, block_q, num_tiles=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kvh,head_dim", [(3, 64), (2, 128)])
def test_write_kv_cache_stores_each_token_at_its_slot(dtype: torch.dtype, kvh: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(kvh)
    num_blocks, block_size, tokens = 6, 16, 9
    qkv = torch.randn(tokens, 4 + 2 * kvh, head_dim, generator=g).to(dtype).to(DEVICE)
    key, value = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]  # strided views, like the model's split
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1  # padding: skipped
    k_cache = torch.zeros(num_blocks, block_size, kvh, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    write_kv_cache(key, value, k_cache, v_cache, slots.to(DEVICE))
    keep = slots >= 0
    want_k = torch.zeros(num_blocks * block_size, kvh, head_dim, dtype=dtype)
    want_v = torch.zeros_like(want_k)
    want_k[slots[keep]], want_v[slots[keep]] = key.cpu()[keep], value.cpu()[keep]
    assert torch.equal(k_cache.cpu().flatten(0, 1), want_k)
    assert torch.equal(v_cache.cpu().flatten(0, 1), want_v)


def _attention_args() -> dict[str, object]:
    case = ragged_case(16, 2, 2, 64, torch.float32, [1, 3], [5, 3])
    return {k: case[k] for k in ("query", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables")}


BAD_ATTENTION: dict[str, tuple[Callable[[dict], None], str]] = {
    "query 2-d": (lambda a: a.update(query=a["query"][:, 0]), "query must be"),
    "heads not a multiple": (lambda a: a.update(query=a["query"][:, :3]), "multiple of kv heads"),
    "dtype mismatch": (lambda a: a.update(query=a["query"].half()), "dtype"),
    "float index": (lambda a: a.update(seq_lens=a["seq_lens"].float()), "seq_lens must be int32 or int64"),
    "short query_start_loc": (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "num_seqs \\+ 1"),
    "v_cache shape": (lambda a: a.update(v_cache=a["v_cache"][:1]), "v_cache shape"),
    "cache not contiguous": (
        lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "contiguous",
    ),
    "head_dim stride": (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "unit stride"),
    "table 1-d": (lambda a: a.update(block_tables=a["block_tables"][0]), "block_tables must have 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_ATTENTION))
def test_paged_attention_rejects_bad_arguments(case: str) -> None:
    args = _attention_args()
    mutate, message = BAD_ATTENTION[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, scale=0.1, max_query_len=3)  # type: ignore[arg-type]


def test_write_kv_cache_rejects_bad_arguments() -> None:
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="key must be \\(T, 2, 64\\)"):
        write_kv_cache(key[:, :1], key, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        write_kv_cache(key, key, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="value dtype"):
        write_kv_cache(key, key.double(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="k_cache must be"):
        write_kv_cache(key, key, cache[0], cache[0].clone(), slots)


COMPILE = """
from jitney.worker.attention.triton import _paged_attention_kernel as attn
from jitney.worker.kernels.triton.cache import _write_kv_kernel as write

# Each (dtype, variant) is a compile of ~10 s: bf16 every variant, fp32 (its own dot) the
# plain and the featured, fp16 (bf16's code but for the type) the plain one.
VARIANTS = {"bf16": ((False, False), (True, False), (False, True)), "fp16": ((False, False),),
            "fp32": ((False, False), (False, True))}
for arch in (80, 90):
    for dt in ("bf16", "fp16", "fp32"):
        # the runner's block tables are int32; features: window, soft cap and sinks all on
        for flat, features in VARIANTS[dt]:
            build(attn, [f"*{dt}"] * 4 + ["*i64", "*i64", "*i32", "*i64", "*i64", "*fp32"] + ["fp32"] * 2
                  + ["i32"] * 10,
                  dict(G=3, GP=4, HEAD_DIM=128, HEAD_P=128, BLOCK_Q=16, BLOCK_N=64, F32_DOT=dt == "fp32",
                       FLAT=flat, WINDOW=features, SOFTCAP=features, SINKS=features), arch)
        build(write, [f"*{dt}"] * 4 + ["*i64"] + ["i32"] * 6, dict(NUM_HEADS=3, HEADS_P=4, HEAD_DIM=64, HEAD_P=64), arch)
print("compiled")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA compiler ships for Linux only")
def test_kernels_compile_for_sm80_and_sm90_without_a_gpu() -> None:
    """What the interpreter cannot check: the kernels lower to PTX (Ampere, Hopper)."""
    compile_for_gpus(COMPILE)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batch_invariant_decodes_launch_the_prefills_tile(monkeypatch: pytest.MonkeyPatch,
                                                           batch_invariant: bool) -> None:
    """With --batch-invariant a decode launch runs the same tile height (so the
    same dot shapes) as a prefill launch; by default decodes take a smaller tile."""
    import jitney.worker.attention.triton as module
    from jitney.worker.attention.backend import AttentionMetadata

    launches: list[dict[str, object]] = []

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(module, "_paged_attention_kernel", Spy())
    backend = module.TritonPagedAttention(batch_invariant=batch_invariant)
    k_cache = torch.zeros(8, 4, 2, 16, device=DEVICE)
    for query_lens in ([1, 1], [5, 3]):
        meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=[9, 7], block_tables=[[0, 1, 2], [3, 4]],
                                       block_size=4, device=DEVICE)
        backend.attend(torch.zeros(sum(query_lens), 8, 16, device=DEVICE), k_cache, k_cache, meta, 0.25)
    decode, prefill = launches
    assert (decode["BLOCK_Q"] == prefill["BLOCK_Q"]) == batch_invariant
    assert decode["BLOCK_N"] == prefill["BLOCK_N"]
