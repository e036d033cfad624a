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

gpt-oss's variant: a router with a bias whose top-k *logits* are softmaxed
(``topk_then_softmax``), experts with biases and a clamped SwiGLU
(``activation="gpt_oss"``, ``kernels/cpu/moe.py``), loaded from its stacked
checkpoint tensors, plain or MXFP4 (``StackedExperts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jitney.worker.kernels.cpu.ops import RoutedExperts
from jitney.worker.layers.linear import NO_SHARD, Loaded, ReplicatedLinear, Shard, loaded_shape, whole
from jitney.worker.layers.mxfp4 import dequantize_mxfp4


class FusedExperts(nn.Module):
    """E experts stacked: ``gate_up (E, 2I, H)`` (gate rows, then up), ``down (E, H, I)``,
    I this rank's share; loaded one checkpoint tensor (expert, part) at a time.

    ``bias``: ``gate_up_bias (E, 2I)`` and ``down_bias (E, H)`` too (under tensor
    parallelism the down bias is rank 0's, zeros elsewhere, so the all-reduce adds it
    once). ``activation``: "silu" (silu(gate) * up) or "gpt_oss" (the clamped SwiGLU,
    ``alpha`` and ``limit``: ``kernels/cpu/moe.py``'s ``ACTIVATIONS``)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard: Shard = NO_SHARD, *,
                 bias: bool = False, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if activation not in ("silu", "gpt_oss"):
            raise ValueError(f"experts' activation must be silu or gpt_oss, got {activation!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.shard = shard
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.kernel: nn.Module | None = None
        self.triton = False

    def parts_of(self, leaf: str) -> list[tuple[int, str]]:
        """The checkpoint tensors (expert, part) that fill parameter ``leaf``."""
        parts = ("down",) if leaf.startswith("down") else ("gate", "up")
        return [(e, p) for e in range(self.num_experts) for p in parts]

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: tuple[int, str]) -> None:
        expert, part = shard_id
        inter, hidden = self.intermediate_size, self.hidden_size
        size, rank = self.shard.size, self.shard.rank
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"weight {name}: expert {expert} of a layer of {self.num_experts}")
        bias = leaf.endswith("_bias")
        matrix = (size * inter, hidden) if part != "down" else (hidden, size * inter)
        want: tuple[int, ...] = matrix[:1] if bias else matrix
        if loaded_shape(loaded) != want:
            raise ValueError(f"weight {name}: shape {loaded_shape(loaded)}, expected {want}")
        lo, hi = rank * inter, (rank + 1) * inter
        if bias and part == "down":   # added once over the group: rank 0's
            self.down_bias[expert].copy_(whole(loaded) if rank == 0 else torch.zeros(want))  # type: ignore[index]
        elif bias:
            start = 0 if part == "gate" else inter
            self.gate_up_bias[expert, start:start + inter].copy_(whole(loaded)[lo:hi])  # type: ignore[index]
        elif part == "down":
            self.down[expert].copy_(loaded[:, lo:hi])
        else:
            start = 0 if part == "gate" else inter
            self.gate_up[expert, start:start + inter].copy_(loaded[lo:hi])

    def use_cpu_kernel(self) -> None:
        """Run on the CPU's batch-invariant experts kernel from now on (its own packed copy)."""
        from jitney.worker.kernels.cpu.moe import InvariantMoeExperts

        self.kernel = InvariantMoeExperts(self.gate_up, self.down, self.gate_up_bias, self.down_bias,
                                          activation=self.activation, alpha=self.alpha, limit=self.limit)
        for name in ("gate_up", "down", "gate_up_bias", "down_bias"):   # the kernel holds them
            if getattr(self, name) is not None:
                setattr(self, name, nn.Parameter(self.gate_up.new_empty(0), requires_grad=False))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The torch path's activation (the CPU kernel's, op for op)."""
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

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

            return fused_experts(x, self.gate_up, self.down, topk_ids, topk_weights, self.gate_up_bias,
                                 self.down_bias, activation=self.activation, alpha=self.alpha, limit=self.limit)
        inter = self.intermediate_size
        acc = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        for slot in range(topk_ids.shape[1]):    # top-k order, as the CPU kernel adds them
            ids = topk_ids[:, slot]
            for expert in ids.unique().tolist():
                rows = (ids == expert).nonzero().squeeze(1)
                gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias[expert]
                gate_up = F.linear(x[rows], self.gate_up[expert], gate_up_bias)
                y = F.linear(self.act(gate_up[:, :inter], gate_up[:, inter:]), self.down[expert],
                             None if self.down_bias is None else self.down_bias[expert])
                acc[rows] += topk_weights[rows, slot, None] * y.float()
        return acc.to(x.dtype)


class SparseMoe(nn.Module):
    """Router + experts: ``gate (H -> E)``, ``experts``; ``top_k`` of E per token,
    their softmax weights renormalised to sum 1 when ``normalize``.

    ``topk_then_softmax`` (gpt-oss): the top k of the router's logits, softmaxed among
    themselves (the same weights as a softmax over all renormalised, other roundings).
    ``router_bias``: the router has a bias. ``experts``: a family's own experts module
    (built with these sizes) in place of a plain ``FusedExperts``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 normalize: bool, shard: Shard = NO_SHARD, router_bias: bool = False,
                 topk_then_softmax: bool = False, experts: FusedExperts | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top-{top_k} of {num_experts} experts")
        self.top_k, self.normalize, self.topk_then_softmax = top_k, normalize, topk_then_softmax
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=router_bias)
        self.experts = experts if experts is not None else FusedExperts(num_experts, hidden_size,
                                                                         intermediate_size, shard)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (expert ids, weights), both (T, k), in descending weight order."""
        if self.topk_then_softmax:
            logits, ids = torch.topk(self.gate.forward(x).float(), self.top_k, dim=-1)
            return ids, F.softmax(logits, dim=-1)
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
        if kernel is None:
            return None
        return RoutedExperts(self.gate, kernel, self.top_k, self.normalize, self.topk_then_softmax)


class StackedExperts(FusedExperts):
    """gpt-oss's experts, loaded from its checkpoint's stacked tensors (each a whole
    layer's E experts), plain or MXFP4 (``mxfp4``: ``layers/mxfp4.py``, de-quantised
    here to the parameters' dtype).

    Plain, transformers' ``GptOssExperts``: ``gate_up_proj (E, H, 2I)`` applied as
    ``x @ W``, its gate and up columns interleaved (gate even, up odd; the bias
    ``(E, 2I)`` alike), and ``down_proj (E, I, H)``, its bias ``(E, H)``. MXFP4 (the
    released checkpoints): ``gate_up_proj_blocks (E, 2I, H / 32, 16)`` and
    ``_scales (E, 2I, H / 32)``, rows interleaved the same way, and ``down_proj_blocks
    (E, H, I / 32, 16)``; the biases stay plain. Checkpoint parts are named
    ("plain" | "blocks" | "scales"); an MXFP4 tensor waits for its other half.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard: Shard = NO_SHARD, *,
                 mxfp4: bool = False, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, shard, bias=True, activation="gpt_oss",
                         alpha=alpha, limit=limit)
        self.mxfp4 = mxfp4
        self._pending: dict[tuple[str, str], torch.Tensor] = {}   # (leaf, "blocks" | "scales") -> uint8

    def parts_of(self, leaf: str) -> list[tuple[int, str]] | list[str]:   # type: ignore[override]
        return ["blocks", "scales"] if self.mxfp4 and leaf in ("gate_up", "down") else ["plain"]

    def weight_loader(self, name: str, leaf: str, loaded: Loaded, shard_id: object) -> None:
        if shard_id in ("blocks", "scales"):
            if not self.mxfp4 or leaf not in ("gate_up", "down"):
                raise ValueError(f"weight {name}: MXFP4 {shard_id} where the config names no MXFP4 experts")
            self._pending[(leaf, str(shard_id))] = whole(loaded)
            blocks, scales = self._pending.get((leaf, "blocks")), self._pending.get((leaf, "scales"))
            if blocks is not None and scales is not None:
                del self._pending[(leaf, "blocks")], self._pending[(leaf, "scales")]
                self._load_mxfp4(name, leaf, blocks, scales)
            return
        if self.mxfp4 and leaf in ("gate_up", "down"):
            raise ValueError(f"weight {name}: a plain tensor where the config names MXFP4 experts")
        self._load_plain(name, leaf, loaded)

    def _rank_columns(self) -> tuple[int, int]:
        inter = self.intermediate_size
        return self.shard.rank * inter, (self.shard.rank + 1) * inter

    def _load_plain(self, name: str, leaf: str, loaded: Loaded) -> None:
        experts, hidden, inter, size = self.num_experts, self.hidden_size, self.intermediate_size, self.shard.size
        want = {"gate_up": (experts, hidden, 2 * size * inter), "down": (experts, size * inter, hidden),
                "gate_up_bias": (experts, 2 * size * inter), "down_bias": (experts, hidden)}[leaf]
        if loaded_shape(loaded) != want:
            raise ValueError(f"weight {name}: shape {loaded_shape(loaded)}, expected {want}")
        lo, hi = self._rank_columns()
        param = getattr(self, leaf)
        if leaf == "down_bias":
            param.copy_(whole(loaded) if self.shard.rank == 0 else torch.zeros(want))
            return
        for e in range(experts):     # an expert at a time: a lazy slice reads only that expert
            w = loaded[e:e + 1][0]
            if leaf == "down":
                param[e].copy_(w[lo:hi].t())                                     # (H, I)
            elif leaf == "gate_up":
                param[e].copy_(torch.cat([w[:, 0::2][:, lo:hi], w[:, 1::2][:, lo:hi]], dim=1).t())   # (2I, H)
            else:
                param[e].copy_(torch.cat([w[0::2][lo:hi], w[1::2][lo:hi]]))

    def _load_mxfp4(self, name: str, leaf: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        experts, hidden, inter, size = self.num_experts, self.hidden_size, self.intermediate_size, self.shard.size
        rows, cols = (2 * size * inter, hidden) if leaf == "gate_up" else (hidden, size * inter)
        if cols % 32 or tuple(blocks.shape) != (experts, rows, cols // 32, 16) \
                or tuple(scales.shape) != (experts, rows, cols // 32):
            raise ValueError(f"weight {name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}, "
                             f"expected ({experts}, {rows}, {cols // 32}, 16) and ({experts}, {rows}, {cols // 32})")
        lo, hi = self._rank_columns()
        param = getattr(self, leaf)
        for e in range(experts):     # an expert at a time: float32 de-quantised once, then the dtype's
            w = dequantize_mxfp4(blocks[e], scales[e], param.dtype)             # (rows, cols)
            if leaf == "down":
                param[e].copy_(w[:, lo:hi])
            else:
                param[e].copy_(torch.cat([w[0::2][lo:hi], w[1::2][lo:hi]]))
