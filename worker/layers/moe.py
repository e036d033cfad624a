"""A sparse mixture-of-experts block: a router, then each token's top-k experts.

``SparseMoe`` is called as a layer program's LINEAR (``h = moe(h)``): the router
(``gate``, replicated, a linear like any other) scores the experts, softmax in
float32, the top k kept (renormalised to sum 1 where the family says so), and
``FusedExperts`` computes only the routed experts' rows. On the CPU the experts
run ``kernels/cpu/moe.py`` (each routed expert's weights read once per step, a
token's k outputs added in top-k order in float32: batch-invariant); on CUDA the
Triton fused-MoE kernel (``kernels/triton/moe.py``: pairs sorted by expert, each
expert's weights read once per block of its rows, the same top-k order); elsewhere
a torch loop over the routed experts adds them in the same order.

Tensor parallelism splits every expert's intermediate size across the ranks
(gate and up rows, down columns), so the block's output is a partial sum that
the program's REDUCE all-reduces, as after a dense MLP's down_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jitney.worker.kernels.cpu.ops import RoutedExperts
from jitney.worker.layers.linear import NO_SHARD, Loaded, ReplicatedLinear, Shard, loaded_shape


class FusedExperts(nn.Module):
    """E experts stacked: ``gate_up (E, 2I, H)`` (gate rows, then up), ``down (E, H, I)``,
    I this rank's share; loaded one checkpoint tensor (expert, part) at a time."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard: Shard = NO_SHARD) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.shard = shard
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.kernel: nn.Module | None = None
        self.triton = False

    def parts_of(self, leaf: str) -> list[tuple[int, str]]:
        """The checkpoint tensors (expert, part) that fill parameter ``leaf``."""
        return [(e, p) for e in range(self.num_experts) for p in (("down",) if leaf == "down" else ("gate", "up"))]

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: tuple[int, str]) -> None:
        expert, part = shard_id
        inter, hidden = self.intermediate_size, self.hidden_size
        size, rank = self.shard.size, self.shard.rank
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"weight {name}: expert {expert} of a layer of {self.num_experts}")
        want = (size * inter, hidden) if part != "down" else (hidden, size * inter)
        if loaded_shape(loaded) != want:
            raise ValueError(f"weight {name}: shape {loaded_shape(loaded)}, expected {want}")
        lo, hi = rank * inter, (rank + 1) * inter
        if part == "down":
            self.down[expert].copy_(loaded[:, lo:hi])
        else:
            start = 0 if part == "gate" else inter
            self.gate_up[expert, start:start + inter].copy_(loaded[lo:hi])

    def use_cpu_kernel(self) -> None:
        """Run on the CPU's batch-invariant experts kernel from now on (its own packed copy)."""
        from jitney.worker.kernels.cpu.moe import InvariantMoeExperts

        self.kernel = InvariantMoeExperts(self.gate_up, self.down)
        self.gate_up = nn.Parameter(self.gate_up.new_empty(0), requires_grad=False)   # the kernel holds them
        self.down = nn.Parameter(self.down.new_empty(0), requires_grad=False)

    def use_triton_kernel(self) -> bool:
        """Run on the Triton fused-MoE kernel from now on (CUDA; it reads these weights in
        place). False, the torch loop kept, where the triton package is missing."""
        try:
            import jitney.worker.kernels.triton.moe  # noqa: F401
        except ImportError:
            return False
        self.triton = True
        return True

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            out: torch.Tensor = self.kernel.forward(x, topk_ids, topk_weights)
            return out
        if self.triton:
            from jitney.worker.kernels.triton.moe import fused_experts

            return fused_experts(x, self.gate_up, self.down, topk_ids, topk_weights)
        inter = self.intermediate_size
        acc = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        for slot in range(topk_ids.shape[1]):    # top-k order, as the CPU kernel adds them
            ids = topk_ids[:, slot]
            for expert in ids.unique().tolist():
                rows = (ids == expert).nonzero().squeeze(1)
                gate_up = F.linear(x[rows], self.gate_up[expert])
                y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down[expert])
                acc[rows] += topk_weights[rows, slot, None] * y.float()
        return acc.to(x.dtype)


class SparseMoe(nn.Module):
    """Router + experts: ``gate (H -> E)``, ``experts``; ``top_k`` of E per token,
    their softmax weights renormalised to sum 1 when ``normalize``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 normalize: bool, shard: Shard = NO_SHARD) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top-{top_k} of {num_experts} experts")
        self.top_k, self.normalize = top_k, normalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, shard)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (expert ids, weights), both (T, k), in descending weight order."""
        probs = F.softmax(self.gate.forward(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts.forward(x, ids, weights)

    def cpu_parts(self) -> RoutedExperts | None:
        """This block for the CPU's C++ layer stack, which makes ``forward``'s calls in
        C++ (``csrc/layer_stack.cpp``); None before its experts run the CPU kernel."""
        kernel = self.experts.kernel
        return None if kernel is None else RoutedExperts(self.gate, kernel, self.top_k, self.normalize)
