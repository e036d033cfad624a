"""The CPU layer kernels (``worker/kernels/cpu/csrc/elementwise.cpp``) through ``InvariantCpuLayerOps``.

Each against its torch reference (``TorchLayerOps``, ``rms_norm_torch``):

* rotary + cache write and the residual add: bit for bit (the same IEEE
  operations, rounded to the dtype at the same points);
* the norms: their float32 mean of squares is summed in another order than
  torch's, so an element may differ from torch's by one rounding of the
  dtype: within rtol 2**-7 in bfloat16 (two bf16 units in the last place at
  worst; observed: one, on ~1e-5 of the elements) and rtol 1e-6 in float32
  (observed ~1.3e-7).

And each row's bits do not depend on the rows beside it: every row of a call
over 2, 17, 64 or 513 rows equals the same row computed alone, also with
2 threads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.invariance_driver import torch_threads
from tests.support.tiny_models import make_tiny_llama, make_tiny_qwen2
from jitney.worker.attention.backend import (AttentionBackend, AttentionMetadata, InvariantCpuAttention, TorchPagedAttention,
                                     from_kernel_layout, to_kernel_layout)
from jitney.worker.layers.ops import InvariantCpuLayerOps, TorchLayerOps, rms_norm_torch
from jitney.worker.layers.rotary import rope_inv_freq

DTYPES = [torch.bfloat16, torch.float32]
ROWS = [1, 2, 17, 64, 513]
NORM_RTOL = {torch.bfloat16: 2.0**-7, torch.float32: 1e-6}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> InvariantCpuLayerOps:
    return InvariantCpuLayerOps(rope_inv_freq(64, 10000.0, None))


def rows_alone_match(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """fn over x[:m] gives, for every m of ROWS, each row's bits of fn over that row alone."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
    for m in ROWS:
        assert torch.equal(fn(x[:m]), alone[:m]), f"rows differ from the same rows alone at {m} rows"
    with torch_threads(2):
        assert torch.equal(fn(x), alone), "rows differ with 2 threads"


def assert_norm_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=NORM_RTOL[got.dtype], atol=0)


# ---------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_rms_norm_matches_torch_and_is_row_invariant(ops: InvariantCpuLayerOps, dtype: torch.dtype,
                                                     hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(513, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    assert_norm_close(ops.rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5))
    rows_alone_match(lambda a: ops.rms_norm(a, weight, 1e-5), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_add_rms_norm_in_place_matches_torch_and_is_row_invariant(ops: InvariantCpuLayerOps, dtype: torch.dtype,
                                                                  hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden + 1)
    x = torch.randn(513, hidden, generator=gen).to(dtype)
    residual = (torch.randn(513, hidden, generator=gen) * 4).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ref_out, ref_residual = TorchLayerOps(ops.inv_freq).add_rms_norm(x, residual, weight, 1e-6)
    x_in, res_in = x.clone(), residual.clone()
    out, new_residual = ops.add_rms_norm(x_in, res_in, weight, 1e-6)
    assert out is x_in and new_residual is res_in  # both in place
    assert torch.equal(new_residual, ref_residual)
    assert_norm_close(out, ref_out)

    def both(rows: torch.Tensor) -> torch.Tensor:  # (m, 2 hidden): x beside residual, on copies
        a, b = rows[:, :hidden].clone(), rows[:, hidden:].clone()
        return torch.cat(ops.add_rms_norm(a, b, weight, 1e-6), dim=-1)

    rows_alone_match(both, torch.cat((x, residual), dim=-1))


# ---------------------------------------------------------------------------- rotary + cache


def rope_problem(dtype: torch.dtype, heads: tuple[int, int, int], rows: int, block: int = 16,
                 seed: int = 0) -> dict[str, Any]:
    nh, kvh, d = heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-rows // block) + 3
    qkv = (torch.randn(rows, (nh + 2 * kvh) * d, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, 30000, (rows,), generator=gen)
    slots = torch.randperm(num_blocks * block, generator=gen)[:rows]
    k_cache = torch.randn(num_blocks, block, kvh, d, generator=gen).to(dtype)
    return {"qkv": qkv, "positions": positions, "slots": slots, "k_cache": k_cache,
            "v_cache": torch.randn(k_cache.shape, generator=gen).to(dtype)}


def run_rope(ops: TorchLayerOps, p: dict[str, Any], heads: tuple[int, int, int], dtype: torch.dtype,
             rows: slice = slice(None), backend: AttentionBackend | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k_cache, v_cache) after ops.rope_and_cache over rows ``rows`` of the problem (on cache
    copies), through ``backend``'s write_kv where ``ops`` are the torch ones. The CPU kernels
    (and InvariantCpuAttention) write their own layout: their caches come back token-major."""
    backend = backend if backend is not None else TorchPagedAttention()
    kernel_layout = isinstance(ops, InvariantCpuLayerOps) or isinstance(backend, InvariantCpuAttention)
    kv = (to_kernel_layout(p["k_cache"], p["v_cache"]) if kernel_layout
          else (p["k_cache"].clone(), p["v_cache"].clone()))
    rope = TorchLayerOps(ops.inv_freq).rope_inputs(p["positions"][rows], dtype)
    meta = SimpleNamespace(slot_mapping=p["slots"][rows])
    q = ops.rope_and_cache(p["qkv"][rows], rope, kv, meta, backend, heads)  # type: ignore[arg-type]
    return (q, *from_kernel_layout(*kv)) if kernel_layout else (q, *kv)


HEADS = [(9, 3, 64), (4, 2, 128), (4, 4, 32), (14, 2, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_rope_and_cache_equals_torch_bit_for_bit(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    inv_freq = rope_inv_freq(heads[2], 10000.0, None)
    ops, ref = InvariantCpuLayerOps(inv_freq), TorchLayerOps(inv_freq)
    for rows in ROWS:
        p = rope_problem(dtype, heads, rows, seed=rows)
        got, expected = run_rope(ops, p, heads, dtype), run_rope(ref, p, heads, dtype)
        # The torch ops through the invariant backend's write_kv: the kernel's layout too.
        through_backend = run_rope(ref, p, heads, dtype, backend=InvariantCpuAttention())
        assert got[0].shape == (rows, heads[0], heads[2]) and got[0].is_contiguous()
        for a, b, c in zip(got, expected, through_backend):
            assert torch.equal(a, b) and torch.equal(c, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_writes_only_the_mapped_slots(dtype: torch.dtype) -> None:
    heads = (9, 3, 64)
    ops = InvariantCpuLayerOps(rope_inv_freq(64, 10000.0, None))
    p = rope_problem(dtype, heads, 17, block=4)
    p["slots"][5] = -1  # a padding token: stores nothing
    q, k, v = run_rope(ops, p, heads, dtype)
    flat_k, flat_v = k.view(-1, 3, 64), v.view(-1, 3, 64)
    old_k, old_v = p["k_cache"].view(-1, 3, 64), p["v_cache"].view(-1, 3, 64)
    mapped = p["slots"][p["slots"] >= 0]
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[mapped] = False
    assert torch.equal(flat_k[untouched], old_k[untouched]) and torch.equal(flat_v[untouched], old_v[untouched])
    values = p["qkv"][:, 12 * 64:].view(17, 3, 64)
    for t, slot in enumerate(p["slots"].tolist()):
        if slot >= 0:
            assert torch.equal(flat_v[slot], values[t])
            assert not torch.equal(flat_k[slot], old_k[slot])
    # The rotated k is the rotated q's arithmetic: a kv head equal to a q head rotates the same way.
    same = p["qkv"].clone()
    same[:, 9 * 64:10 * 64] = same[:, :64]
    q2, k2, _ = run_rope(ops, {**p, "qkv": same}, heads, dtype)
    assert torch.equal(k2.view(-1, 3, 64)[p["slots"][0]][0], q2[0, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    heads = (9, 3, 64)
    ops = InvariantCpuLayerOps(rope_inv_freq(64, 10000.0, None))
    p = rope_problem(dtype, heads, 513)
    full_q, full_k, full_v = run_rope(ops, p, heads, dtype)
    for m in ROWS:
        q, k, v = run_rope(ops, p, heads, dtype, slice(0, m))
        assert torch.equal(q, full_q[:m])
        slots = p["slots"][:m]
        assert torch.equal(k.view(-1, 3, 64)[slots], full_k.view(-1, 3, 64)[slots])
        assert torch.equal(v.view(-1, 3, 64)[slots], full_v.view(-1, 3, 64)[slots])
    for t in (0, 200, 512):  # alone
        assert torch.equal(run_rope(ops, p, heads, dtype, slice(t, t + 1))[0][0], full_q[t])
    with torch_threads(2):
        assert all(torch.equal(a, b) for a, b in zip(run_rope(ops, p, heads, dtype), (full_q, full_k, full_v)))


# ---------------------------------------------------------------------------- bad input


def test_bad_input_raises_a_clear_error(ops: InvariantCpuLayerOps) -> None:
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    with pytest.raises(RuntimeError, match="weight is Float"):
        ops.rms_norm(x, w.float(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, torch.randn(32).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.rms_norm(x.half(), w.half(), 1e-5)
    with pytest.raises(RuntimeError, match="2-D"):
        ops.rms_norm(x[0], w, 1e-5)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.add_rms_norm(x.clone(), torch.randn(4, 64), w, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.add_rms_norm(x.clone(), torch.randn(64, 4).bfloat16().t(), w, 1e-5)
    heads = (9, 3, 64)
    p = rope_problem(torch.bfloat16, heads, 5)
    token_major = p["k_cache"]
    p["k_cache"], p["v_cache"] = to_kernel_layout(p["k_cache"], p["v_cache"])

    def rope(**changes: Any) -> None:
        q = {**p, **changes}
        cos, sin = TorchLayerOps(ops.inv_freq).rope_inputs(p["positions"], torch.bfloat16)
        ops.rope_and_cache(q["qkv"], (q.get("cos", cos), sin), (q["k_cache"], q["v_cache"]),
                           SimpleNamespace(slot_mapping=q["slots"]), TorchPagedAttention(),  # type: ignore[arg-type]
                           q.get("heads", heads))

    with pytest.raises(RuntimeError, match="qkv must be"):
        rope(qkv=p["qkv"][:, :-64])
    with pytest.raises(RuntimeError, match="qkv must be"):
        rope(heads=(8, 3, 64))
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        rope(cos=torch.zeros(5, 32).bfloat16())
    with pytest.raises(RuntimeError, match="cos, sin and the caches must be"):
        rope(cos=torch.zeros(5, 64))
    with pytest.raises(RuntimeError, match="cos, sin and the caches must be"):
        rope(k_cache=p["k_cache"].float(), v_cache=p["v_cache"].float())
    with pytest.raises(RuntimeError, match="caches must be"):
        rope(k_cache=p["k_cache"][:, :2])
    with pytest.raises(RuntimeError, match="caches must be K"):   # token-major: not the kernel's layout
        rope(k_cache=token_major, v_cache=token_major.clone())
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        rope(slots=p["slots"].int())
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        rope(slots=p["slots"][:4])
    with pytest.raises(RuntimeError, match="past the cache"):
        rope(slots=p["slots"] + 10_000)
    with pytest.raises(RuntimeError, match="head_dim even"):
        rope(heads=(9, 3, 0))


# ---------------------------------------------------------------------------- through the model


@pytest.mark.parametrize("kind", ["qwen2-bias", "llama-d128"])
def test_model_with_cpu_layer_ops_matches_torch_layer_ops(tmp_path: Path, kind: str) -> None:
    """qkv bias (Qwen2) and head_dim 128 with GQA (2 heads, 1 kv head) take the same op:
    the model's logits with the kernels are those of the torch ops (fp32, within 1e-4)."""
    from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache
    from jitney.worker.loading.loader import load_model

    if kind == "qwen2-bias":
        path = make_tiny_qwen2(tmp_path / "m")
    else:
        path = make_tiny_llama(tmp_path / "m", hidden_size=256, num_heads=2, num_kv_heads=1)
    net, _ = load_model(str(path), torch.float32, CPU)
    cfg = net.config
    assert (cfg.qkv_bias if kind == "qwen2-bias" else cfg.head_dim == 128)
    ids = torch.randint(0, 320, (23,), generator=torch.Generator().manual_seed(1))

    def logits() -> torch.Tensor:
        geometry = CacheGeometry(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        cache = PagedKVCache(geometry, 16, CPU, net.backend.block_shapes(geometry))
        out = []
        for start, end in ((0, 20), (20, 21), (21, 22), (22, 23)):  # a prefill chunk, then decodes
            meta = AttentionMetadata.build(query_lens=[end - start], seq_lens=[end], block_tables=[[5, 2, 9, 0, 7, 1]],
                                           block_size=4, device=CPU)
            with torch.inference_mode():
                out.append(net.compute_logits(net(ids[start:end], torch.arange(start, end), meta, cache),
                                              torch.arange(end - start)))
        return torch.cat(out)

    net.use_backend(InvariantCpuAttention(), 256)
    assert isinstance(net.ops, InvariantCpuLayerOps)
    with_kernels = logits()
    net.ops = TorchLayerOps(net.ops.inv_freq)
    torch.testing.assert_close(with_kernels, logits(), atol=1e-4, rtol=0)
