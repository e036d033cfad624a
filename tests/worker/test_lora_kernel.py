"""The CPU's LoRA kernel (csrc/lora.cpp, ``jitney_cpu.lora_add``) against the torch path
(``layers/lora.py``'s ``lora_delta``): within rounding of it, every row's bits its own
whatever the batch, its grouping or the threads, the float32 AVX-512 lanes the portable
loops' bits, base rows untouched, bad arguments refused before y changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.layers.lora import lora_delta

# (slots, rank, in, out, y's width, offset): ranks below, at and past a lane's 16, odd
# sizes, columns not a multiple of 16, a slice in the middle of y, rank 1 of one input,
# and SmolLM2's down_proj shape (last: the invariance test's).
SHAPES = [(4, 16, 64, 32, 96, 32), (3, 8, 40, 19, 50, 31), (2, 24, 33, 70, 70, 0), (3, 1, 1, 5, 9, 2),
          (5, 16, 1536, 576, 576, 0)]


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _adapters(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A, B, scale with slot 0 all zeros (the base model), as ``LoraSlots`` holds them."""
    slots, rank, inp, out = shape[:4]
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(slots, rank, inp, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(slots, out, rank, generator=gen) * 0.3).to(dtype)
    scale = torch.rand(slots, generator=gen) + 0.5
    a[0], b[0], scale[0] = 0, 0, 0
    return a, b, scale


def _inputs(tokens: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, ...]:
    slots, _, inp, _, width, _ = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inp, generator=gen).to(dtype)
    y = torch.randn(tokens, width, generator=gen).to(dtype)
    index = torch.randint(0, slots, (tokens,), generator=gen, dtype=torch.int32)
    index[: min(tokens, slots)] = torch.arange(min(tokens, slots), dtype=torch.int32)   # every slot, base too
    return x, y, index


def _added(y: torch.Tensor, x: torch.Tensor, adapters: tuple[torch.Tensor, ...], slots: torch.Tensor, offset: int,
           portable: bool = False) -> torch.Tensor:
    out = y.clone()
    cpu_kernels.lora_add(out, x, *adapters, slots, offset, portable)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_torch_delta(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    adapters = _adapters(shape, dtype)
    x, y, slots = _inputs(37, shape, dtype)
    offset, out = shape[5], shape[3]
    got = _added(y, x, adapters, slots, offset)
    delta = lora_delta(x, *adapters, slots)
    want = y.clone()
    want[:, offset: offset + out] = (want[:, offset: offset + out].float() + delta).to(dtype)
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * delta.abs().max().item())
    else:   # y's rounding, and (AVX-512 BF16) A x rounded to bf16 as PEFT's lora_A rounds it
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -6 * delta.abs().max().item())
    assert not torch.equal(got, y)
    outside = torch.ones(y.shape[1], dtype=torch.bool)
    outside[offset: offset + out] = False
    assert torch.equal(got[:, outside], y[:, outside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_rows_keep_their_bits(dtype: torch.dtype) -> None:
    shape = SHAPES[0]
    adapters = _adapters(shape, dtype)
    x, y, slots = _inputs(9, shape, dtype)
    y[slots == 0, 40] = -0.0    # (adding a zero delta would make it +0.0)
    got = _added(y, x, adapters, slots, shape[5])
    base = slots == 0
    assert base.any() and torch.equal(got[base].view(torch.int16 if dtype is torch.bfloat16 else torch.int32),
                                      y[base].view(torch.int16 if dtype is torch.bfloat16 else torch.int32))
    assert torch.equal(_added(y, x, adapters, torch.zeros_like(slots), shape[5]), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_portable_loops_give_the_same_bits(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Float32 fmas give the same bits in AVX-512 lanes and the plain loops; AVX-512 BF16's
    pairs (bf16 adapters where the CPU has it) differ from them, within rounding."""
    adapters = _adapters(shape, dtype, seed=3)
    x, y, slots = _inputs(21, shape, dtype, seed=4)
    fast, portable = _added(y, x, adapters, slots, shape[5]), _added(y, x, adapters, slots, shape[5], True)
    if dtype is torch.bfloat16 and cpu_kernels.lora_kernel() == "avx512_bf16":
        delta = lora_delta(x, *adapters, slots).abs().max().item()
        torch.testing.assert_close(fast.float(), portable.float(), rtol=2 ** -7, atol=2 ** -6 * delta)
    else:
        assert torch.equal(fast, portable)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_depend_on_it_alone(dtype: torch.dtype) -> None:
    """Each row alone, in batches of 1, 5, 19 and 64 rows (groups of 1 to ~20 rows, cut into
    work items at other places), in another order, at 1 and 2 threads: the same bits."""
    shape = SHAPES[-1]
    adapters = _adapters(shape, dtype, seed=5)
    x, y, slots = _inputs(64, shape, dtype, seed=6)
    offset = shape[5]
    torch.set_num_threads(2)
    together = _added(y, x, adapters, slots, offset)
    for t in range(64):
        alone = _added(y[t: t + 1], x[t: t + 1], adapters, slots[t: t + 1], offset)
        assert torch.equal(alone[0], together[t]), t
    for rows in (5, 19):
        part = _added(y[:rows], x[:rows], adapters, slots[:rows], offset)
        assert torch.equal(part, together[:rows])
    order = torch.randperm(64, generator=torch.Generator().manual_seed(7))
    assert torch.equal(_added(y[order], x[order], adapters, slots[order], offset), together[order])
    torch.set_num_threads(1)
    assert torch.equal(_added(y, x, adapters, slots, offset), together)


def _bad(**change: object) -> dict[str, object]:
    dtype = torch.bfloat16
    a, b, scale = _adapters(SHAPES[0], dtype)
    x, y, slots = _inputs(6, SHAPES[0], dtype)
    args: dict[str, object] = {"y": y, "x": x, "a": a, "b": b, "scale": scale, "slots": slots, "offset": 32}
    args.update(change)
    return args


@pytest.mark.parametrize(("change", "message"), [
    ({"x": torch.zeros(6, 64)}, "x, A and B must have y's dtype"),
    ({"scale": torch.zeros(4, dtype=torch.bfloat16)}, "scale must be float32"),
    ({"slots": torch.zeros(6, dtype=torch.int64)}, "slots must be int32"),
    ({"slots": torch.tensor([0, 1, 4, 0, 0, 0], dtype=torch.int32)}, "token 2 has slot 4, not in 0..3"),
    ({"slots": torch.tensor([0, 1, -1, 0, 0, 0], dtype=torch.int32)}, "token 2 has slot -1"),
    ({"slots": torch.zeros(5, dtype=torch.int32)}, "x, y and slots have 6, 6 and 5 rows"),
    ({"x": torch.zeros(6, 63, dtype=torch.bfloat16)}, "x has 63 features, A takes 64"),
    ({"b": torch.zeros(4, 32, 8, dtype=torch.bfloat16)}, "A has rank 16, B 8"),
    ({"scale": torch.zeros(3)}, "A, B and scale hold 4, 4 and 3 slots"),
    ({"offset": 65}, r"columns \[65, 97\) are not within y's 96"),
    ({"a": torch.zeros(4, 16, dtype=torch.bfloat16)}, r"A must be \(slots, rank, in\)"),
    ({"y": torch.zeros(96, 6, dtype=torch.bfloat16).t()}, "y's rows must be contiguous"),
    ({"y": torch.zeros(6, 96, dtype=torch.float16)}, "y must be bfloat16 or float32"),
])
def test_bad_arguments_are_refused(change: dict[str, object], message: str) -> None:
    args = _bad(**change)
    y = args["y"]
    assert isinstance(y, torch.Tensor)
    before = y.clone()
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.lora_add(**args)  # type: ignore[arg-type]
    assert torch.equal(y, before)
