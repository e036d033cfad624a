"""Linear layers that know their tensor-parallel shard and load their own weights.

Each is an ``nn.Linear`` of the rank's local shape (so the kernels' swaps and the
C++ layer stack read it as any linear) with a ``weight_loader`` that takes a
whole Hugging Face tensor, or a lazy safetensors slice of one, and copies in
this rank's part. Megatron-style splits, rank ``r`` of ``N``:

    layer                         weight rows (out)        weight columns (in)   bias
    ReplicatedLinear              all                      all                   all
    ColumnParallelLinear          [r out/N, (r+1) out/N)   all                   its rows
    MergedColumnParallelLinear    that cut of each part    all                   its rows
    QKVParallelLinear             its q heads, its KV heads all                  its rows
    RowParallelLinear             all                      [r in/N, (r+1) in/N)  rank 0; zeros elsewhere

A merged layer's parts (gate and up; q, k and v) come either as separate
checkpoint tensors, each named by a ``shard_id``, or as one already-fused
tensor (Phi-3's ``qkv_proj`` and ``gate_up_proj``), which the loader cuts into
its parts before taking this rank's rows of each: a fused tensor is never
replicated whole onto every rank. A row-parallel bias is added once (rank 0
holds it; the zeros elsewhere add nothing to the all-reduce's sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# A checkpoint tensor as the loaders see it: a torch tensor, or a safetensors
# slice (``safe_open(...).get_slice``) that reads only the rows or columns asked for.
# Both index as ``[a:b]`` and ``[:, a:b]``.
Loaded = Any


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a tensor-parallel group of ``size``."""

    rank: int
    size: int


NO_SHARD = Shard(0, 1)


def loaded_shape(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _rows(loaded: Loaded, start: int, stop: int) -> torch.Tensor:
    part: torch.Tensor = loaded[start:stop]
    return part


def _columns(loaded: Loaded, start: int, stop: int) -> torch.Tensor:
    part: torch.Tensor = loaded[:, start:stop]
    return part


def whole(loaded: Loaded) -> torch.Tensor:
    tensor: torch.Tensor = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    return tensor


def _check(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise ValueError(f"weight {name}: shape {got}, expected {expected}")


def default_weight_loader(name: str, param: torch.Tensor, loaded: Loaded) -> None:
    """A replicated parameter (norms, embeddings, the head): the whole tensor."""
    _check(name, loaded_shape(loaded), tuple(param.shape))
    param.copy_(whole(loaded))


class ParallelLinear(nn.Linear):
    """An ``nn.Linear`` of this rank's shape that loads its part of a checkpoint tensor.

    ``parts``: the ids of the checkpoint tensors that make up the weight (one
    ``None`` for a single tensor); a load is complete when each was given, or
    one fused tensor (``shard_id`` None) was.
    """

    parts: tuple[str | int | None, ...] = (None,)

    def __init__(self, in_features: int, out_features: int, *, bias: bool, shard: Shard = NO_SHARD) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.shard = shard

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: str | int | None = None) -> None:
        """Copy this rank's part of ``loaded`` (HF tensor ``name``) into parameter ``leaf``."""
        default_weight_loader(name, getattr(self, leaf), loaded)


class ReplicatedLinear(ParallelLinear):
    """Every rank holds the whole layer."""


class ColumnParallelLinear(ParallelLinear):
    """The output features split across ranks; ``sizes``: the local size of each part
    (merged layers stack several), in checkpoint order."""

    def __init__(self, in_features: int, sizes: tuple[int, ...], *, bias: bool, shard: Shard = NO_SHARD,
                 part_ids: tuple[str | int | None, ...] = (None,)) -> None:
        super().__init__(in_features, sum(sizes), bias=bias, shard=shard)
        assert len(sizes) == len(part_ids)
        self.sizes, self.parts = sizes, part_ids

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: str | int | None = None) -> None:
        param = getattr(self, leaf)
        shape = loaded_shape(loaded)
        rank, size = self.shard.rank, self.shard.size
        if shard_id is None:   # the whole layer in one tensor: cut it into its parts first
            _check(name, shape, (size * param.shape[0], *param.shape[1:]))
            pieces = list(zip(self.sizes, [size * s for s in self.sizes]))
        else:
            index = self.parts.index(shard_id)
            pieces = [(self.sizes[index], size * self.sizes[index])]
            _check(name, shape, (pieces[0][1], *param.shape[1:]))
        local = sum(self.sizes[: self.parts.index(shard_id)]) if shard_id is not None else 0
        source = 0
        for width, total in pieces:
            param[local: local + width].copy_(_rows(loaded, source + rank * width, source + (rank + 1) * width))
            local, source = local + width, source + total


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input stacked by rows (gate and up:
    part ids 0 and 1); ``sizes`` local."""

    def __init__(self, in_features: int, sizes: tuple[int, ...], *, bias: bool, shard: Shard = NO_SHARD) -> None:
        super().__init__(in_features, sizes, bias=bias, shard=shard, part_ids=tuple(range(len(sizes))))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v stacked by rows (part ids "q", "k", "v"), each rank with its
    (local) ``num_heads`` q heads and ``num_kv_heads`` KV heads: contiguous head
    ranges, so GQA's grouping holds on every rank."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool,
                 shard: Shard = NO_SHARD) -> None:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, (q, kv, kv), bias=bias, shard=shard, part_ids=("q", "k", "v"))


class RowParallelLinear(ParallelLinear):
    """The input features split across ranks (``in_features`` local): each rank's
    output is a partial sum that the caller all-reduces."""

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: str | int | None = None) -> None:
        param = getattr(self, leaf)
        rank, size = self.shard.rank, self.shard.size
        if leaf == "bias":
            _check(name, loaded_shape(loaded), tuple(param.shape))
            if rank == 0:
                param.copy_(whole(loaded))
            else:
                param.zero_()
            return
        width = self.in_features
        _check(name, loaded_shape(loaded), (param.shape[0], size * width))
        param.copy_(_columns(loaded, rank * width, (rank + 1) * width))
