"""LoRA adapter slots: each targeted linear's adapters, stacked, and their per-token add.

For each (layer, PEFT module) the model offers (``LoraTarget``: which of the layer
program's linears it is and which slice of that linear's output it writes, so the
fused ``qkv_proj`` and ``gate_up_proj`` get one LoRA per part), the slots hold

    A      (max_loras + 1, R, in)    R = --max-lora-rank, each adapter zero-padded to it
    B      (max_loras + 1, out, R)
    scale  (max_loras + 1,) float32  lora_alpha / r (or / sqrt(r), rsLoRA), kept apart from
                                     B so that B holds the checkpoint's values exactly

on the model's device and dtype. Slot 0 is the base model: all zeros, never written,
so a base row's delta is exactly zero. A token of slot ``s`` gains
``scale[s] * B[s] @ (A[s] @ x)`` in float32, added to the linear's output slice
by the layer ops' ``lora_add`` (``layers/ops.py``): ``lora_delta`` here in torch, the
CPU's invariant path ``csrc/lora.cpp`` (as the C++ layer stack, which holds these
tensors themselves: ``stack_targets``).

A load (``load``) zeroes the slot first and writes it only once every tensor was read
and checked, so a failed load leaves the slot empty, never half-written; the error
names the adapter and its folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from jitney.common.lora_adapter import AdapterError, ModuleShape, check_adapter, read_adapter


@dataclass(frozen=True)
class LoraTarget:
    """A PEFT module of every decoder layer: the layer program's linear ``linear``,
    output columns ``[offset, offset + out_features)`` of it."""

    name: str
    linear: int
    offset: int
    in_features: int
    out_features: int


class LoraAdd(Protocol):
    """What adds a target's deltas (the layer ops, ``layers/ops.py``): in place into y's columns from ``offset``."""

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 slots: torch.Tensor, offset: int) -> None: ...


class LoraLoadError(RuntimeError):
    """An adapter that could not be put in its slot (the slot is left empty)."""


class LoraSlots:
    def __init__(self, targets: list[LoraTarget], num_layers: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.targets = {t.name: t for t in targets}
        self.num_layers, self.max_loras, self.max_rank = num_layers, max_loras, max_rank
        slots = max_loras + 1
        self.a = {(i, t.name): torch.zeros(slots, max_rank, t.in_features, dtype=dtype, device=device)
                  for i in range(num_layers) for t in targets}
        self.b = {(i, t.name): torch.zeros(slots, t.out_features, max_rank, dtype=dtype, device=device)
                  for i in range(num_layers) for t in targets}
        self.scale = {(i, t.name): torch.zeros(slots, dtype=torch.float32, device=device)
                      for i in range(num_layers) for t in targets}
        # layer program's linear index -> its targets, for ``apply``
        self.by_linear: dict[int, list[LoraTarget]] = {}
        for t in targets:
            self.by_linear.setdefault(t.linear, []).append(t)
        self.names: dict[int, str] = {}   # slot -> the adapter it holds

    def modules(self) -> list[ModuleShape]:
        """What ``Ready.lora_modules`` reports (whole sizes: LoRA runs without tensor parallelism)."""
        return [ModuleShape(t.name, t.in_features, t.out_features, self.num_layers) for t in self.targets.values()]

    def clear(self, slot: int) -> None:
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
            self.scale[key][slot] = 0.0
        self.names.pop(slot, None)

    def load(self, slot: int, name: str, path: str) -> None:
        """Put adapter ``name`` (a PEFT folder at ``path``) in ``slot`` (1..max_loras), replacing
        what it held. Raises ``LoraLoadError`` naming the adapter and path; the slot is then empty."""
        if not 1 <= slot <= self.max_loras:
            raise LoraLoadError(f"LoRA adapter {name!r} ({path}): slot {slot} is not in 1..{self.max_loras}")
        self.clear(slot)
        try:
            from safetensors.torch import load_file

            spec = read_adapter(path)
            check_adapter(spec, self.modules(), self.max_rank)
            tensors = load_file(str(spec.weights_file))
        except (AdapterError, OSError, ValueError, RuntimeError) as e:
            raise LoraLoadError(f"LoRA adapter {name!r} ({path}) could not be loaded: {e}") from None
        for t in spec.tensors:
            key = (t.layer, t.module)
            self.a[key][slot, : t.rank].copy_(tensors[t.a_key])
            self.b[key][slot, :, : t.rank].copy_(tensors[t.b_key])
            self.scale[key][slot] = t.scaling
        self.names[slot] = name

    def apply(self, layer: int, linear: int, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor,
              ops: LoraAdd) -> torch.Tensor:
        """``y`` (the linear's output for input ``x``) with each token's adapter added by
        ``ops.lora_add``; ``slots`` (T,) int32, the token's slot (0: none)."""
        for t in self.by_linear.get(linear, ()):
            key = (layer, t.name)
            ops.lora_add(y, x, self.a[key], self.b[key], self.scale[key], slots, t.offset)
        return y

    def stack_targets(self, layer: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Layer ``layer``'s targets for the C++ stack: (linear, offset, A, B, scale), the
        slots' own tensors (a load rewrites them in place), in ``apply``'s order."""
        return [(linear, t.offset, self.a[(layer, t.name)], self.b[(layer, t.name)], self.scale[(layer, t.name)])
                for linear, targets in self.by_linear.items() for t in targets]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """The torch path: ``scale[s] * B[s] @ (A[s] @ x[t])`` (T, out) in float32, each token's
    products summed over the last dimension on their own (a ``bmm``'s kernel choice, and so
    its summation order, changes with the batch; a last-dimension ``sum`` reduces each row
    alone), so a row's delta does not depend on the rows beside it."""
    index = slots.long()
    shrunk = (a.index_select(0, index).float() * x.float().unsqueeze(1)).sum(-1)          # (T, R)
    shrunk = shrunk * scale.index_select(0, index).unsqueeze(1)
    return (b.index_select(0, index).float() * shrunk.unsqueeze(1)).sum(-1)              # (T, out)
