"""The physical paged KV cache: sizing and the tensors themselves.

The scheduler owns the logical cache (which block belongs to whom); the
worker only allocates ``num_blocks`` blocks per layer and writes/reads them
where the plan's block tables say.
"""

from __future__ import annotations

from dataclasses import dataclass

import math
import mmap

import torch

GIB = 1024**3
DEFAULT_CPU_CACHE_GIB = 2.0
GPU_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class CacheGeometry:
    """Per-layer shape of the cache, minus the number of blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        """K and V of one block in all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def size_cache(
    geometry: CacheGeometry,
    device: torch.device,
    *,
    num_blocks: int | None,
    kv_cache_gib: float | None,
    reserve_bytes: int = 0,
) -> int:
    """How many blocks to allocate.

    Exactly ``num_blocks`` if given; else as many as fit in ``kv_cache_gib``;
    else 2 GiB on CPU. On CUDA: the memory free now (call it after the model
    is loaded and the activations' profile ran, so both are counted as
    used), less ``1 - GPU_MEMORY_FRACTION`` of the card (headroom) and less
    ``reserve_bytes`` (what the CUDA graphs captured later will take).
    """
    if num_blocks is not None:
        return num_blocks
    if kv_cache_gib is not None:
        budget = int(kv_cache_gib * GIB)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - GPU_MEMORY_FRACTION) * total) - reserve_bytes
    else:
        budget = int(DEFAULT_CPU_CACHE_GIB * GIB)
    blocks = budget // geometry.bytes_per_block()
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {geometry.bytes_per_block()} bytes"
        )
    return blocks


BlockShapes = tuple[tuple[int, ...], tuple[int, ...]]
"""The shapes of one block of K and of V in one layer (the attention backend's layout)."""


def token_major(geometry: CacheGeometry) -> BlockShapes:
    """K and V blocks shaped (block_size, kvh, head_dim): token ``j`` of a block is row ``j``."""
    shape = (geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
    return shape, shape


class PagedKVCache:
    """K and V for every layer, each block shaped as the attention backend
    reads it (``block_shapes``; default ``token_major``), so a layer's K is
    ``(num_blocks, *block_shapes[0])``.

    One allocation holds everything; ``layer(i)`` returns views into it.
    """

    def __init__(self, geometry: CacheGeometry, num_blocks: int, device: torch.device,
                 block_shapes: BlockShapes | None = None) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        g = geometry
        self.block_shapes = block_shapes if block_shapes is not None else token_major(g)
        per_block = g.block_size * g.num_kv_heads * g.head_dim
        if any(math.prod(shape) != per_block for shape in self.block_shapes):
            raise ValueError(f"block shapes {self.block_shapes} do not hold {per_block} values a block")
        # (2, layers, num_blocks, values a block); zeroed so padding reads
        # are finite (they are masked, but NaN * 0 would still be NaN).
        shape = (2, g.num_layers, num_blocks, per_block)
        self._pages: mmap.mmap | None = None
        if device.type == "cpu":
            # Anonymous memory that the kernel zeroes page by page on first
            # touch: a 2 GiB cache costs nothing until used, instead of ~1 s
            # of memset on every start (a restarted worker waits for it).
            nbytes = math.prod(shape) * g.dtype.itemsize
            self._pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._pages, dtype=g.dtype, count=math.prod(shape)).view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=g.dtype, device=device)
        # Each layer's views, made once: indexing them out of the tensor in every layer of
        # every step took 0.43 ms of a one-sequence CPU decode step (cProfile).
        k_shape, v_shape = self.block_shapes
        self._layers = tuple((self.tensor[0, i].view(num_blocks, *k_shape), self.tensor[1, i].view(num_blocks, *v_shape))
                             for i in range(g.num_layers))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer."""
        return self._layers[index]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
