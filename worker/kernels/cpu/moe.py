"""A mixture-of-experts layer's experts on the CPU, batch-invariant (``csrc/moe.cpp``).

``InvariantMoeExperts`` holds one layer's E experts, packed once, and computes,
for each token, the sum over its k routed experts of ``weight * down(act(gate) * up)``,
running only the routed experts: the step's tokens are grouped by expert and
each routed expert's projections run once over its rows (bf16 on the kernels
of ``InvariantLinear``, the same bits per row; float32 in plain loops). A
token's k expert outputs are added in top-k order (the order of ``topk_ids``'
columns) in float32 and rounded once, so a token's output bits never depend
on the other tokens of the step, on its row, on chunking or on the threads.

Weights follow transformers' Mixtral / Qwen3-MoE experts: ``gate_up (E, 2I, H)``,
the gate's rows then the up's, ``down (E, H, I)``; gpt-oss's checkpoint layout
converts with ``from_gpt_oss_layout``. Under tensor parallelism each rank holds
a slice of every expert's intermediate size (``shard_experts``) and the caller
all-reduces the partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from jitney.worker.kernels.cpu.ops import load

ACTIVATIONS = ("silu", "gpt_oss")
"""``silu``: silu(gate) * up (Mixtral, Qwen3-MoE). ``gpt_oss``: transformers'
``GptOssExperts._apply_gate``, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``
with ``g = min(gate, limit)``."""


class InvariantMoeExperts(nn.Module):
    """One layer's experts through ``jitney_cpu.moe_experts``.

    ``gate_up (E, 2I, H)``, ``down (E, H, I)``: x's dtype (bfloat16 or float32);
    I is this rank's share of the intermediate size. ``gate_up_bias (E, 2I)`` and
    ``down_bias (E, H)`` are optional (gpt-oss has them). ``alpha`` and ``limit``
    are gpt-oss's ``swiglu_alpha`` and ``swiglu_limit``. ``out_float``: return the
    float32 sums unrounded (say, for an all-reduce in float32). ``portable``: bf16
    through the plain loops whatever the CPU has (for tests; its bits differ).
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, *, activation: str = "silu", alpha: float = 1.702,
                 limit: float = 7.0, out_float: bool = False, portable: bool = False) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if gate_up.dim() != 3 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be (experts, 2 * intermediate, hidden), got {tuple(gate_up.shape)}")
        experts, two_i, hidden = gate_up.shape
        inter = two_i // 2
        if down.shape != (experts, hidden, inter):
            raise ValueError(f"down must be ({experts}, {hidden}, {inter}), got {tuple(down.shape)}")
        if gate_up_bias is not None and gate_up_bias.shape != (experts, two_i):
            raise ValueError(f"gate_up_bias must be ({experts}, {two_i}), got {tuple(gate_up_bias.shape)}")
        if down_bias is not None and down_bias.shape != (experts, hidden):
            raise ValueError(f"down_bias must be ({experts}, {hidden}), got {tuple(down_bias.shape)}")
        load()
        self.num_experts, self.hidden_size, self.intermediate_size = experts, hidden, inter
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.out_float, self.portable = out_float, portable
        pack = torch.ops.jitney_cpu.pack_moe_weight
        weights = gate_up.detach()
        self.gate, self.up = pack(weights[:, :inter]), pack(weights[:, inter:])   # each (E, I, H) packed
        self.down = pack(down.detach())
        bias = None if gate_up_bias is None else gate_up_bias.detach().float()
        self.gate_bias = None if bias is None else bias[:, :inter].contiguous()
        self.up_bias = None if bias is None else bias[:, inter:].contiguous()
        self.down_bias = None if down_bias is None else down_bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x (T, H)``, ``topk_ids (T, k)`` integers in [0, E), ``topk_weights (T, k)``
        (float32; other floats are converted) -> ``(T, H)``, x's dtype unless ``out_float``."""
        y: torch.Tensor = torch.ops.jitney_cpu.moe_experts(
            x, topk_ids, topk_weights, self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias,
            self.hidden_size, self.intermediate_size, self.activation, self.alpha, self.limit, self.out_float,
            self.portable)
        return y


ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""(gate_up (E, 2I, H), down (E, H, I), gate_up_bias (E, 2I) or None, down_bias (E, H) or None)."""


def from_gpt_oss_layout(gate_up_proj: torch.Tensor, gate_up_proj_bias: torch.Tensor, down_proj: torch.Tensor,
                        down_proj_bias: torch.Tensor) -> ExpertWeights:
    """transformers' ``GptOssExperts`` tensors -> ``InvariantMoeExperts``' layout.

    There ``gate_up_proj (E, H, 2I)`` is applied as ``x @ gate_up_proj[e]`` with the
    gate and up columns interleaved (gate ``0::2``, up ``1::2``, the bias alike), and
    ``down_proj (E, I, H)`` as ``h @ down_proj[e]``.
    """
    gate_up = torch.cat([gate_up_proj[..., 0::2], gate_up_proj[..., 1::2]], dim=2).transpose(1, 2).contiguous()
    bias = torch.cat([gate_up_proj_bias[..., 0::2], gate_up_proj_bias[..., 1::2]], dim=1).contiguous()
    return gate_up, down_proj.transpose(1, 2).contiguous(), bias, down_proj_bias


def shard_experts(weights: ExpertWeights, rank: int, size: int) -> ExpertWeights:
    """Rank ``rank`` of ``size``'s part of every expert (worker/distributed/sharding.py's
    split of an MLP): rows ``[r I/N, (r+1) I/N)`` of the gate and of the up (and of
    their bias), the matching input columns of down; the down bias on rank 0 only,
    zeros elsewhere, so the all-reduce adds it once."""
    gate_up, down, gate_up_bias, down_bias = weights
    inter = gate_up.shape[1] // 2
    if inter % size:
        raise ValueError(f"the experts' intermediate size {inter} does not split {size} ways")
    width = inter // size
    lo = rank * width
    gate_up_part = torch.cat([gate_up[:, lo:lo + width], gate_up[:, inter + lo:inter + lo + width]], dim=1)
    bias_part = None if gate_up_bias is None else torch.cat(
        [gate_up_bias[:, lo:lo + width], gate_up_bias[:, inter + lo:inter + lo + width]], dim=1)
    down_part = down[:, :, lo:lo + width].contiguous()
    down_bias_part = down_bias if down_bias is None or rank == 0 else torch.zeros_like(down_bias)
    return gate_up_part, down_part, bias_part, down_bias_part
