"""A checkpoint's tensors, one at a time, as the model's weight loaders take them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from jitney.worker.layers.linear import Loaded


def safetensors_tensors(paths: list[Path]) -> Iterator[tuple[str, Loaded]]:
    """Each tensor of these safetensors files as a lazy slice: a weight loader reads
    only the rows or columns its tensor-parallel rank keeps."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def drained(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, Loaded]]:
    """The tensors of ``state``, each removed as it is handed out, so the
    checkpoint and the model never hold the whole model twice."""
    while state:
        name = next(iter(state))
        yield name, state.pop(name)
