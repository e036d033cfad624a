"""Loading a family's model from Hugging Face-named checkpoint tensors.

A family names the checkpoint tensors its merged layers are stacked from
(``Stacked``: Llama's q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``);
every other tensor loads into the parameter of its own name. Each tensor goes
through its layer's ``weight_loader`` (``layers/linear.py``), which takes this
tensor-parallel rank's part, so the checkpoint is read once, in any order, a
tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from jitney.worker.layers.linear import Loaded, ParallelLinear, default_weight_loader

# (the merged parameter's module suffix, a checkpoint module suffix, the part it is)
Stacked = tuple[tuple[str, str, "str | int"], ...]
# A family's own renaming, tried first: checkpoint name -> (parameter, part), or None
# (stacked experts: each expert's tensor names its expert; ``layers/moe.py``).
Rename = Callable[[str], "tuple[str, object] | None"]


def _target(name: str, stacked: Stacked) -> tuple[str, str | int | None]:
    """The parameter HF tensor ``name`` loads into, and which part of it (None: all)."""
    module, _, leaf = name.rpartition(".")
    for merged, source, part in stacked:
        if module.endswith(source):
            return f"{module[: -len(source)]}{merged}.{leaf}", part
    return name, None


def _sources(param: str, parts: Iterable[str | int | None], stacked: Stacked) -> list[str]:
    """The checkpoint tensor names that would fill ``parts`` of ``param``."""
    module, _, leaf = param.rpartition(".")
    names = []
    for part in parts:
        found = [f"{module[: -len(merged)]}{source}.{leaf}" for merged, source, p in stacked
                 if p == part and module.endswith(merged)]
        names += found or [param]
    return names


def load_checkpoint(model: nn.Module, tensors: Iterable[tuple[str, Loaded]], stacked: Stacked,
                    dtype: torch.dtype, device: torch.device, rename: Rename | None = None) -> list[str]:
    """Fill every parameter of ``model`` (built on the meta device) from ``tensors``.

    Returns the names of the tensors no parameter took. Raises ``ValueError``
    naming a missing tensor or one of the wrong shape.
    """
    for name, param in list(model.named_parameters()):
        prefix, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(prefix), leaf,
                nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False))
    params = dict(model.named_parameters())
    filled: dict[str, set[object]] = {}
    unused: list[str] = []
    with torch.no_grad():
        for name, loaded in tensors:
            renamed = rename(name) if rename is not None else None
            target, part = renamed if renamed is not None else _target(name, stacked)
            if target not in params:
                unused.append(name)
                continue
            prefix, _, leaf = target.rpartition(".")
            module: Any = model.get_submodule(prefix)
            if isinstance(module, ParallelLinear) or hasattr(module, "weight_loader"):
                module.weight_loader(name, leaf, loaded, part)
            else:
                default_weight_loader(name, params[target], loaded)
            filled.setdefault(target, set()).add(part)
    missing: list[str] = []
    for name in params:
        prefix, _, leaf = name.rpartition(".")
        owner: Any = model.get_submodule(prefix)
        parts = owner.parts_of(leaf) if hasattr(owner, "parts_of") else getattr(owner, "parts", (None,))
        got = filled.get(name, set())
        absent = [] if None in got else [p for p in parts if p not in got]
        if any(isinstance(p, tuple) for p in absent):   # stacked experts: (expert, part)
            missing.append(f"{name} ({len(absent)} of its {len(parts)} parts, e.g. {absent[0]})")
        else:
            missing += _sources(name, absent, stacked)
    if missing:
        raise ValueError(f"checkpoint lacks {', '.join(missing)}")
    return unused
