"""The Triton segmented LoRA kernels (``kernels/triton/lora.py``) against ``layers/lora.py``'s
torch delta: mixed steps of base rows and adapters of several ranks, one row, 2000 rows, all-base
steps, float32 and bf16 (and fp16), a row's bits alone and in a batch, the block tables, bad arguments.

Without CUDA the kernels run under the Triton interpreter on CPU tensors, so the shapes are
small, but ``in`` is split into two chunks (the second partial), ``out`` is not a multiple of
the column tile, an adapter gets two blocks of rows, and the padded rank R is not always a
power of two. The ``cuda`` tests at the end run 1B-shaped linears, and a CUDA graph of the
launches replayed with other slots, on a card.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support.triton_support import DEVICE, compile_for_gpus, interpret_without_cuda, skip_unless_interpreted

triton = interpret_without_cuda()

from jitney.worker.kernels.triton.lora import (  # noqa: E402
    BLOCK_M, K_CHUNK, lora_add_triton, lora_blocks, lora_delta_triton,
)
from jitney.worker.layers.lora import lora_delta  # noqa: E402

skip_unless_interpreted(triton)

IN, OUT, SLOTS = K_CHUNK + 44, 72, 5          # two chunks of ``in``, the second 44 wide
RANKS = {1: 3, 2: 8, 3: 16}                   # slot -> its adapter's rank; slot 4 stays empty
SCALES = {1: 2.0, 2: 0.5, 3: 1.25}
DTYPES = [torch.float32, torch.bfloat16]


def adapters(seed: int, dtype: torch.dtype, rank: int = 16, ranks: dict[int, int] = RANKS,
             n_in: int = IN, n_out: int = OUT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``LoraSlots``' layout: each adapter zero-padded to ``rank``, slot 0 (and unused slots) zero."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(SLOTS, rank, n_in)
    b = torch.zeros(SLOTS, n_out, rank)
    scale = torch.zeros(SLOTS)
    for slot, r in ranks.items():
        a[slot, :r] = torch.randn(r, n_in, generator=g) / 8
        b[slot, :, :r] = torch.randn(n_out, r, generator=g) / 2
        scale[slot] = SCALES[slot]
    return a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE), scale.to(DEVICE)


def rows(seed: int, n: int, dtype: torch.dtype, n_in: int = IN) -> torch.Tensor:
    return torch.randn(n, n_in, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def mixed_slots(seed: int, n: int) -> torch.Tensor:
    """Unsorted: base rows and slots 1..3, slot 3 on more than a block's rows."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([0.2, 0.1, 0.1, 0.6])
    return torch.multinomial(weights, n, replacement=True, generator=g).to(torch.int32).to(DEVICE)


def reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
    return lora_delta(x.cpu(), a.cpu(), b.cpu(), scale.cpu(), slots.cpu())


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Both sum float32 products of the same inputs (bf16 products are exact): only the order differs."""
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_mixed_step_matches_the_torch_delta(dtype: torch.dtype) -> None:
    a, b, scale = adapters(1, dtype)
    x, slots = rows(2, 70, dtype), mixed_slots(3, 70)
    assert int((slots == 3).sum()) > BLOCK_M and int((slots == 0).sum()) > 0
    got = lora_delta_triton(x, a, b, scale, slots)
    assert got.dtype == torch.float32 and got.shape == (70, OUT)
    close(got, reference(x, a, b, scale, slots))
    assert (got[slots == 0] == 0).all()


def test_a_step_of_two_thousand_rows() -> None:
    """Many blocks per adapter, and the grid's bound on them (more blocks than adapters' rows fill)."""
    a, b, scale = adapters(24, torch.bfloat16, n_in=40, n_out=24)
    x, slots = rows(25, 2000, torch.bfloat16, n_in=40), mixed_slots(26, 2000)
    close(lora_delta_triton(x, a, b, scale, slots), reference(x, a, b, scale, slots))


@pytest.mark.parametrize("rank,ranks", [(12, {1: 3, 2: 12}), (80, {1: 80, 3: 5})], ids=["R12", "R80"])
def test_padded_ranks_that_are_not_a_tile(rank: int, ranks: dict[int, int]) -> None:
    """R 12: one partial rank tile; R 80: two tiles in the shrink, two trips over R in the expand."""
    a, b, scale = adapters(4, torch.float32, rank=rank, ranks=ranks, n_in=40)
    x, slots = rows(5, 23, torch.float32, n_in=40), mixed_slots(6, 23)
    close(lora_delta_triton(x, a, b, scale, slots), reference(x, a, b, scale, slots))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_add_is_the_delta_added_in_float32_and_rounded_once(dtype: torch.dtype) -> None:
    """``LoraSlots.apply``'s arithmetic on a column slice of y; base rows and other columns untouched."""
    a, b, scale = adapters(7, dtype)
    x, slots = rows(8, 40, dtype), mixed_slots(9, 40)
    y = torch.randn(40, OUT + 30, generator=torch.Generator().manual_seed(10)).to(dtype).to(DEVICE)
    before = y.clone()
    delta = lora_delta_triton(x, a, b, scale, slots)
    assert lora_add_triton(y, 20, x, a, b, scale, slots) is y
    want = before.clone()
    want[:, 20:20 + OUT] = (before[:, 20:20 + OUT].float() + delta).to(dtype)
    assert torch.equal(y, want)
    base = slots == 0
    assert torch.equal(y[base], before[base])
    ref = (before[:, 20:20 + OUT].cpu().float() + reference(x, a, b, scale, slots)).to(dtype)
    torch.testing.assert_close(y[:, 20:20 + OUT].cpu(), ref, atol=1e-4, rtol=1e-4 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("slot", [0, 1, 3])
def test_a_single_row(slot: int) -> None:
    a, b, scale = adapters(11, torch.bfloat16)
    x, slots = rows(12, 1, torch.bfloat16), torch.tensor([slot], dtype=torch.int64, device=DEVICE)
    got = lora_delta_triton(x, a, b, scale, slots)
    close(got, reference(x, a, b, scale, slots))
    assert (got == 0).all() == (slot == 0)


def test_an_all_base_step_adds_exactly_nothing() -> None:
    a, b, scale = adapters(13, torch.bfloat16)
    x, slots = rows(14, 9, torch.bfloat16), torch.zeros(9, dtype=torch.int32, device=DEVICE)
    assert torch.equal(lora_delta_triton(x, a, b, scale, slots), torch.zeros(9, OUT, device=DEVICE))
    y = rows(15, 9, torch.bfloat16, n_in=OUT)
    before = y.clone()
    lora_add_triton(y, 0, x, a, b, scale, slots)
    assert torch.equal(y, before)
    empty = lora_delta_triton(x[:0], a, b, scale, slots[:0])
    assert empty.shape == (0, OUT)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_step(dtype: torch.dtype) -> None:
    a, b, scale = adapters(16, dtype)
    x, slots = rows(17, 45, dtype), mixed_slots(18, 45)
    blocks = lora_blocks(slots, SLOTS)
    batched = lora_delta_triton(x, a, b, scale, slots, blocks)
    assert torch.equal(batched, lora_delta_triton(x, a, b, scale, slots))   # blocks made inside: the same
    for t in (0, 21, 44):   # alone: row 0 of its adapter's first block
        assert torch.equal(lora_delta_triton(x[t:t + 1], a, b, scale, slots[t:t + 1])[0], batched[t])
    flip = torch.arange(44, -1, -1, device=DEVICE)
    assert torch.equal(lora_delta_triton(x[flip], a, b, scale, slots[flip]), batched[flip])


def test_blocks_cover_each_adapters_rows_in_row_order_and_skip_the_base() -> None:
    slots = torch.tensor([3, 0, 1, 3] * 20, dtype=torch.int32, device=DEVICE)   # slot 3: 40 rows
    blocks = lora_blocks(slots, SLOTS)
    order, block_slot, firsts, starts, counts = (t.cpu() for t in blocks[1:])
    assert counts.tolist() == [20, 20, 0, 40, 0]
    used = block_slot[block_slot >= 0].tolist()
    assert used == [1, 3, 3]                        # ceil(20/32), none for slot 0, ceil(40/32)
    assert (block_slot[len(used):] == -1).all() and len(block_slot) == -(-80 // BLOCK_M) + SLOTS - 1
    for s in (0, 1, 3):
        run = order[starts[s]: starts[s] + counts[s]]
        assert (slots.cpu()[run] == s).all() and run.tolist() == sorted(run.tolist())
    assert block_slot[firsts[1]] == 1 and block_slot[firsts[3]] == 3


CASES = ["x-dims", "a-in", "b-rank", "rank-too-big", "scale-dtype", "slots-dtype", "slots-length",
         "weights-dtype", "device", "blocks", "y-columns", "y-dtype", "y-stride"]


@pytest.mark.parametrize("case", CASES)
def test_bad_arguments_are_refused_with_a_clear_error(case: str) -> None:
    a, b, scale = adapters(19, torch.float32, n_in=40)
    x, slots = rows(20, 6, torch.float32, n_in=40), mixed_slots(21, 6)
    y = torch.zeros(6, OUT, device=DEVICE)
    kw: dict[str, object] = {}
    match = {"x-dims": "x must be 2-d", "a-in": "a must be", "b-rank": "b must be", "rank-too-big": "R in 1..256",
             "scale-dtype": "scale must be", "slots-dtype": "slots must be", "slots-length": "slots must be",
             "weights-dtype": "the slots hold", "device": "is on meta", "blocks": "blocks were made",
             "y-columns": "columns", "y-dtype": "y must be 2-d", "y-stride": "unit column stride"}[case]
    if case == "x-dims":
        x = x[None]
    elif case == "a-in":
        a = a[:, :, :-1]
    elif case == "b-rank":
        b = b[:, :, :-1]
    elif case == "rank-too-big":
        a, b = torch.zeros(SLOTS, 257, 40, device=DEVICE), torch.zeros(SLOTS, OUT, 257, device=DEVICE)
    elif case == "scale-dtype":
        scale = scale.double()
    elif case == "slots-dtype":
        slots = slots.float()
    elif case == "slots-length":
        slots = slots[:-1]
    elif case == "weights-dtype":
        b = b.bfloat16()
    elif case == "device":
        a = torch.empty(a.shape, device="meta")
    elif case == "blocks":
        kw["blocks"] = lora_blocks(slots, SLOTS - 1)
    elif case == "y-columns":
        y = torch.zeros(6, OUT - 1, device=DEVICE)
    elif case == "y-dtype":
        y = torch.zeros(6, OUT, dtype=torch.int32, device=DEVICE)
    else:
        y = torch.zeros(OUT, 6, device=DEVICE).T
    before = y.clone()
    with pytest.raises(ValueError, match=match):
        if case.startswith("y-"):
            lora_add_triton(y, 0, x, a, b, scale, slots)
        else:
            lora_delta_triton(x, a, b, scale, slots, **kw)  # type: ignore[arg-type]
    if not case.startswith("y-"):
        with pytest.raises(ValueError, match=match):
            lora_add_triton(y, 0, x, a, b, scale, slots, **kw)  # type: ignore[arg-type]
    assert torch.equal(y, before)


COMPILE = """
from jitney.worker.kernels.triton import lora as k
import torch

table = ["*i64"] * 5
for arch in (80, 90):
    for dt, f32 in (("bf16", False), ("fp32", True)):
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        cfg = k.shrink_config(2048, 16, dtype)          # Llama-3.2-1B's q/k/v/o/gate/up input
        build(k._shrink_kernel, [f"*{dt}"] * 2 + ["*fp32"] + table + ["i32"] * 5,
              dict(RANK_TILES=1, K_CHUNK=cfg.k_chunk, EVEN_K=True, F32_DOT=f32, BLOCK_M=k.BLOCK_M,
                   BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k), arch)
        build(k._sum_kernel, ["*fp32"] * 2 + ["*i64", "*fp32", "i32", "i32"],
              dict(SPLITS=cfg.splits, BLOCK_T=k.SUM_ROWS, BLOCK_R=16), arch)
        for add in (False, True):
            build(k._expand_kernel, ["*fp32", f"*{dt}", f"*{dt}" if add else "*fp32"] + table + ["i32"] * 5,
                  dict(ADD=add, BLOCK_M=k.BLOCK_M, BLOCK_N=k.BLOCK_N, BLOCK_R=16, SOFT_BF16=False), arch)
print("compiled")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA compiler ships for Linux only")
def test_the_kernels_compile_for_sm80_and_sm90_without_a_gpu() -> None:
    """What the interpreter cannot check: the three kernels lower to PTX (Ampere, Hopper)."""
    compile_for_gpus(COMPILE)


needs_a_card = pytest.mark.skipif(not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
CARD_RANKS = {1: 16, 2: 8, 3: 4, 4: 16}


def card_step(seed: int, n_in: int, n_out: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """bf16 slots of four adapters (ranks 16, 8, 4, 16) and a step whose rows pick slots 0..4."""
    scales = dict(SCALES, **{4: 0.75})
    g = torch.Generator().manual_seed(seed)
    a, b = torch.zeros(SLOTS, 16, n_in), torch.zeros(SLOTS, n_out, 16)
    scale = torch.zeros(SLOTS)
    for slot, r in CARD_RANKS.items():
        a[slot, :r] = torch.randn(r, n_in, generator=g) / 16
        b[slot, :, :r] = torch.randn(n_out, r, generator=g) / 4
        scale[slot] = scales[slot]
    x = torch.randn(tokens, n_in, generator=g)
    slots = torch.randint(0, SLOTS, (tokens,), generator=g, dtype=torch.int32)
    return tuple(t.to("cuda") for t in (x.bfloat16(), a.bfloat16(), b.bfloat16(), scale, slots))


@pytest.mark.cuda
@needs_a_card
@pytest.mark.parametrize("tokens", [1, 37, 300, 2048])
@pytest.mark.parametrize("n_in,n_out", [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)],
                         ids=["q-o", "k-v", "gate-up", "down"])
def test_on_a_card_1b_shaped_linears_match_the_torch_path(n_in: int, n_out: int, tokens: int) -> None:
    x, a, b, scale, slots = card_step(22, n_in, n_out, tokens)
    want = lora_delta(x, a, b, scale, slots)          # the torch path, on the card
    got = lora_delta_triton(x, a, b, scale, slots)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    y = torch.randn(tokens, n_out + 64, device="cuda").bfloat16()
    torch_y = y.clone()
    part = torch_y[:, 64:]
    part.copy_((part.float() + want).to(torch.bfloat16))          # LoraSlots.apply
    lora_add_triton(y, 64, x, a, b, scale, slots)
    assert torch.equal(y[:, :64], torch_y[:, :64])
    torch.testing.assert_close(y.float(), torch_y.float(), atol=2e-2, rtol=1e-2)
    assert (y == torch_y).float().mean().item() >= 0.99   # the same rounding; rare ties of the sums differ


@pytest.mark.cuda
@needs_a_card
def test_on_a_card_a_captured_graph_replays_with_other_slots() -> None:
    """No launch reads a value back: the blocks and all three kernels captured once serve any slots."""
    x, a, b, scale, slots = card_step(23, 2048, 2048, 64)
    y0 = torch.randn(64, 2048, device="cuda").bfloat16()
    y = y0.clone()
    lora_add_triton(y, 0, x, a, b, scale, slots)       # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_add_triton(y, 0, x, a, b, scale, slots, lora_blocks(slots, SLOTS), check=False)
    for seed in (24, 25):
        slots.copy_(torch.randint(0, SLOTS, (64,), generator=torch.Generator().manual_seed(seed)).to(slots))
        y.copy_(y0)
        graph.replay()
        eager = lora_add_triton(y0.clone(), 0, x, a, b, scale, slots)
        assert torch.equal(y, eager)



def test_the_triton_layer_ops_add_the_same_as_the_kernel_and_group_rows_once_a_step() -> None:
    from jitney.worker.layers.ops import TorchLayerOps, TritonLayerOps
    from jitney.worker.layers.rotary import rotary_for

    ops = TritonLayerOps(rotary_for(16, 10000.0, None).to(DEVICE), 8)
    a, b, scale = adapters(11, torch.float32)
    x, slots = rows(12, 9, torch.float32), mixed_slots(13, 9)
    y = torch.randn(9, OUT + 8, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    want = y.clone()
    TorchLayerOps(rotary_for(16, 10000.0, None)).lora_add(want, x, a, b, scale, slots, 8)
    got = y.clone()
    ops.lora_add(got, x, a, b, scale, slots, 8)
    assert ops._lora_blocks is not None and ops._lora_blocks[0] is slots
    first = ops._lora_blocks[1]
    ops.lora_add(got, x, a, b, scale, slots, 8)        # a second linear of the step: the same blocks
    assert ops._lora_blocks[1] is first
    TorchLayerOps(rotary_for(16, 10000.0, None)).lora_add(want, x, a, b, scale, slots, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, :8], y[:, :8])
