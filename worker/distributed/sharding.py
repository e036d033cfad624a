"""Megatron-style shards of a Llama-family checkpoint, one per tensor-parallel rank.

Rank ``r`` of ``N`` keeps, of each Hugging Face tensor:

    tensor                               split       rank r's part
    q_proj, k_proj, v_proj (weight, bias) column     the rows of its heads: q heads [r nh/N, (r+1) nh/N),
                                                     KV heads [r kvh/N, (r+1) kvh/N)
    gate_proj, up_proj (weight, bias)     column     rows [r I/N, (r+1) I/N)
    o_proj.weight, down_proj.weight       row        the input columns matching its heads / its rows of I
    o_proj.bias, down_proj.bias           once       rank 0 the bias, the other ranks zeros
    embedding, norms, lm_head             replicated the whole tensor

so a layer's attention and MLP run on local heads and a local slice of the
intermediate size, and one all-reduce after o_proj and one after down_proj
sum the partial outputs (``model.py``). A row-parallel bias is added once:
rank 0 holds it, so the sum is ``(partial_0 + b) + partial_1 + ...``, and
the zeros elsewhere add nothing. Contiguous head ranges keep GQA's grouping:
q head ``h`` reads KV head ``h // (nh / kvh)``, and both ranges start at
multiples of the group.

The embedding and the head are replicated, not vocabulary-parallel: the
logits need no collective and rank 0 samples from its own (the head is a
small share of a Llama's weights; a 128k vocabulary would change that).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from jitney.worker.models.config import ModelConfig

_COLUMN_HEADS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}
_COLUMN_MLP = ("gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a tensor-parallel group of ``size``."""

    rank: int
    size: int


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming what does not split ``size`` ways."""
    bad = [f"{what} ({value})" for what, value in (("attention heads", cfg.num_heads),
                                                    ("KV heads", cfg.num_kv_heads),
                                                    ("MLP intermediate size", cfg.intermediate_size))
           if value % size]
    if bad:
        raise ValueError(f"tensor parallelism over {size} ranks needs the model's {', '.join(bad)} "
                         f"to be divisible by {size}")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's model has: its heads and its share of the MLP."""
    check_shardable(cfg, size)
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                   intermediate_size=cfg.intermediate_size // size)


def _slice(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int] | str | None:
    """How rank ``shard.rank`` cuts HF tensor ``name``: (dim, start, stop);
    "zeros" (a row-parallel bias off rank 0); None (replicated)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, leaf = parts[-2], parts[-1]
    if module in _COLUMN_HEADS:
        heads = cfg.num_heads if _COLUMN_HEADS[module] == "q" else cfg.num_kv_heads
        width = heads // shard.size * cfg.head_dim
        return 0, shard.rank * width, (shard.rank + 1) * width
    if module in _COLUMN_MLP:
        width = cfg.intermediate_size // shard.size
        return 0, shard.rank * width, (shard.rank + 1) * width
    if module in _ROW:
        if leaf == "bias":
            return None if shard.rank == 0 else "zeros"
        width = (cfg.num_heads * cfg.head_dim if module == "o_proj" else cfg.intermediate_size) // shard.size
        return 1, shard.rank * width, (shard.rank + 1) * width
    return None


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """Rank ``shard.rank``'s part of HF tensor ``name`` (a copy: the whole can be freed)."""
    cut = _slice(name, cfg, shard)
    if cut is None:
        return tensor
    if cut == "zeros":
        return torch.zeros_like(tensor)
    assert isinstance(cut, tuple)
    dim, start, stop = cut
    return tensor.narrow(dim, start, stop - start).clone()


def shard_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, shard: Shard) -> None:
    """Replace every tensor of ``state`` by this rank's part, in place."""
    check_shardable(cfg, shard.size)
    for name in list(state):
        state[name] = shard_tensor(name, state.pop(name), cfg, shard)


def read_safetensors(path: Path, cfg: ModelConfig, shard: Shard | None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; with ``shard``, only that rank's parts are read."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            cut = _slice(name, cfg, shard) if shard is not None and shard.size > 1 else None
            if cut is None:
                state[name] = f.get_tensor(name)
            elif cut == "zeros":
                state[name] = torch.zeros_like(f.get_tensor(name))
            else:
                assert isinstance(cut, tuple)
                dim, start, stop = cut
                part = f.get_slice(name)
                state[name] = part[start:stop] if dim == 0 else part[:, start:stop]
    return state
