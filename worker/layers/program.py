"""A decoder layer as a short list of ops: the one definition of its order.

A model family writes its layer as a ``program``, a tuple of ``(Op, index)``
steps over the layer's norms and linears, and two interpreters run it: ``run``
here (every path, one op at a time through the device's ``LayerOps`` and
attention backend) and ``csrc/layer_stack.cpp``'s ``LayerStack`` (the CPU's
batch-invariant path: every layer of a step in one C++ call, the same kernels
in the same order, so the same bits). A new family reuses the ops; a new kind
of op is one case in each interpreter and its kernel.

The layer's state between ops is ``h`` (what the last op produced) and the
residual stream beside it (``residual``): each residual add is fused with the
norm that follows it.

    INPUT_NORM i   h = norms[i](h), residual = h before it (the first layer: no
                   residual yet); later layers: residual += h, h = norms[i](residual)
    LINEAR i       h = linears[i](h) (a mixture-of-experts block, ``layers/moe.py``, is one)
    ROPE_CACHE     q = rotary(h's q), rotated k and h's v into this layer's cache; h = q
                   (the rotary table ``rope`` is the layer's: ``DecoderLayer.rope``)
    ATTEND         h = attention of q over this layer's cache, (T, heads * head_dim)
    ADD_NORM i     residual += h, h = norms[i](residual)
    SILU_MUL       h = silu(gate) * up, h = [gate, up]
    REDUCE         the all-reduce of a row-parallel output (tensor parallelism; the
                   identity without it)
    QK_NORM i      h's q heads through norms[i], its k heads through norms[i + 1]: an
                   RMSNorm over each head's head_dim (Qwen3), v unchanged
    NORM i         h = norms[i](h), the stream untouched (Gemma's norms after a sublayer)
    GELU_MUL       h = gelu_tanh(gate) * up, h = [gate, up] (Gemma)

ATTEND takes the layer's own attention features (``attend``: a sliding ``window``,
a ``softcap``, ``sinks``; ``attention/backend.py``), none by default.

At the end ``h`` is the layer's output and ``residual`` the stream before it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata
from jitney.worker.layers.lora import LoraSlots
from jitney.worker.layers.norm import RMSNorm
from jitney.worker.layers.ops import TorchLayerOps
from jitney.worker.layers.reduce import Reduce


class Op(enum.IntEnum):
    """The ops of a layer program; the numbers are ``layer_stack.cpp``'s ``Op``."""

    INPUT_NORM = 0
    LINEAR = 1
    ROPE_CACHE = 2
    ATTEND = 3
    ADD_NORM = 4
    SILU_MUL = 5
    REDUCE = 6
    QK_NORM = 7
    NORM = 8
    GELU_MUL = 9


Program = tuple[tuple[Op, int], ...]


def check_program(program: Program, num_norms: int, num_linears: int) -> None:
    """Raise ``ValueError`` on a step whose index names no norm or linear of the layer,
    or a program that does not start from the layer's input norm."""
    if not program or program[0][0] is not Op.INPUT_NORM:
        raise ValueError("a layer program starts with INPUT_NORM")
    for op, index in program:
        limit = num_norms if op in (Op.INPUT_NORM, Op.ADD_NORM, Op.NORM) else num_linears if op is Op.LINEAR else \
            num_norms - 1 if op is Op.QK_NORM else 1
        if not 0 <= index < limit:
            raise ValueError(f"{op.name} {index}: the layer has {limit} of those")


def run(program: Program, norms: Sequence[RMSNorm], linears: Sequence[nn.Module], x: torch.Tensor,
        residual: torch.Tensor | None, rope: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, backend: AttentionBackend, ops: TorchLayerOps, heads: tuple[int, int, int],
        scale: float, reduce: Reduce, attend: dict[str, Any] | None = None,
        lora: tuple[LoraSlots, int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer, op by op: ``(h, residual)`` out of ``(x, residual)`` in (``residual``
    None at the first layer). Linears are called by ``.forward``, not ``__call__``,
    whose hook checks cost ~4 us a call (nothing in Jitney registers hooks on them).
    ``lora``: (the model's adapter slots, this layer's index, each token's slot), when a
    token of the step has an adapter: each targeted linear's output gains it (``ops.lora_add``)."""
    h = x
    for op, index in program:
        if op is Op.LINEAR:
            if lora is None:
                h = linears[index].forward(h)
            else:
                h = lora[0].apply(lora[1], index, h, linears[index].forward(h), lora[2], ops)
        elif op is Op.INPUT_NORM or op is Op.ADD_NORM:
            norm = norms[index]
            if residual is None:
                h, residual = ops.rms_norm(h, norm.weight, norm.eps), h
            else:
                h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        elif op is Op.ROPE_CACHE:
            h = ops.rope_and_cache(h, rope, kv, meta, backend, heads)  # (T, nh, d)
        elif op is Op.ATTEND:
            h = backend.attend(h, kv[0], kv[1], meta, scale, **(attend or {})).reshape(x.shape[0], -1)
        elif op is Op.SILU_MUL:
            h = ops.silu_mul(h)
        elif op is Op.REDUCE:
            h = reduce(h)
        elif op is Op.QK_NORM:
            h = qk_norm(h, norms[index], norms[index + 1], heads, ops)
        elif op is Op.NORM:
            h = ops.rms_norm(h, norms[index].weight, norms[index].eps)
        elif op is Op.GELU_MUL:
            h = ops.gelu_mul(h)
        else:
            raise ValueError(f"unknown layer op {op!r}")
    assert residual is not None
    return h, residual


def qk_norm(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, heads: tuple[int, int, int],
            ops: TorchLayerOps) -> torch.Tensor:
    """``qkv (T, (nh + 2 kvh) d)`` with each q and k head RMS-normalised over its ``d``
    (``layer_stack.cpp``'s QK_NORM does the same calls)."""
    nh, kvh, d = heads
    tokens = qkv.shape[0]
    q = ops.rms_norm(qkv[:, : nh * d].reshape(tokens * nh, d), q_norm.weight, q_norm.eps)
    k = ops.rms_norm(qkv[:, nh * d: (nh + kvh) * d].reshape(tokens * kvh, d), k_norm.weight, k_norm.eps)
    return torch.cat((q.view(tokens, -1), k.view(tokens, -1), qkv[:, (nh + kvh) * d:]), dim=1)
