"""Jitney's Llama-family decoder (Llama, Mistral, Qwen2, SmolLM).

Read top to bottom: config, RMSNorm, rotary frequencies, attention over the
paged cache, SwiGLU MLP, decoder layer, model. The forward pass takes the
flattened tokens of a whole fused step; logits are computed separately and
only at the positions that sample. The elementwise work between the matmuls
(norms with their residual adds, rotary + cache write, SiLU * up) goes
through ``layer_ops``: C++ kernels on the CPU's batch-invariant path
(``csrc/cpu_layer.cpp``), plain torch on ``--no-batch-invariant``'s, fused
Triton kernels with the Triton attention backend.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
fused into one matmul each (``qkv_proj``, ``gate_up_proj``).

Tensor parallelism (``sharding.py``): a rank's model is built from its
local config (its heads, its share of the MLP) and a ``reduce`` that sums a
row-parallel output over the ranks (an all-reduce); it is called after
o_proj and after down_proj, and is the identity without a group.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from jitney.worker.attention import AttentionBackend, AttentionMetadata, InvariantCpuAttention, TorchPagedAttention
from jitney.worker.kv_cache import PagedKVCache
from jitney.worker.layer_ops import InvariantCpuLayerOps, TorchLayerOps, rms_norm_torch


# Sums a row-parallel layer's partial output over the tensor-parallel ranks (in place).
Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (``rope_type`` "llama3" or "linear")."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False


@dataclass(frozen=True)
class ModelFacts:
    """What the scheduler needs to know about the model (sent in Ready)."""

    name: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the weight dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, on the CPU."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth
    # blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: TorchLayerOps,
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)  # (T, (nh + 2 kvh) d); .forward: see CausalLM.forward
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        q = ops.rope_and_cache(qkv, rope, kv, meta, backend, heads)  # (T, nh, d); k, v now in the cache
        out = backend.attend(q, kv[0], kv[1], meta, self.scale)  # (T, nh, d)
        return self.reduce(self.o_proj.forward(out.reshape(x.shape[0], -1)))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce) -> None:
        super().__init__()
        self.reduce = reduce
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        return self.reduce(self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x))))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP.

    The residual stream travels beside the layer's output (``x``, ``residual``)
    so that each residual add is fused with the norm that follows it:

        # layer in:  x = previous MLP output (or the embeddings), residual = stream so far (None at layer 0)
        # layer out: x = this MLP's output,                    residual = stream before that output
    """

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, reduce)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: TorchLayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn.forward(h, rope, kv, meta, backend, ops)
        h, residual = ops.add_rms_norm(h, residual, norm2.weight, norm2.eps)
        return self.mlp.forward(h, ops), residual


class Decoder(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.``)."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce) -> None:
        super().__init__()
        # Given an empty weight, the embedding skips its random init: on the meta
        # device, normal_ would import sympy (~1.5 s of a restarted worker's start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, reduce) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model. Build it on the meta device, then ``load_weights``.

    Under tensor parallelism ``cfg`` is the rank's local config
    (``sharding.local_config``) and ``reduce`` the group's all-reduce.
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, *,
                 reduce: Reduce = no_reduce) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend if backend is not None else TorchPagedAttention()
        self.model = Decoder(cfg, reduce)
        # The elementwise work between matmuls; ``use_backend`` picks the fused ops for Triton.
        self.ops = TorchLayerOps(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        # None: tied to the embedding (until a packed copy takes its place).
        self.lm_head: nn.Module | None = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # The CPU's invariant path runs its layers as one C++ call (``layer_stack``) unless this
        # is False (tests compare the two; benchmarks measure them side by side).
        self.use_layer_stack = True
        # (the cache it was made over, weakly: a model does not keep a cache alive; the stack)
        self._stack: tuple[weakref.ref[PagedKVCache], torch.ScriptObject | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Hidden states (T, hidden) of the step's flattened tokens (T,).

        Writes the tokens' K/V into ``kv_cache`` at ``meta.slot_mapping``.
        """
        meta = self.backend.prepare(meta)  # once per step, for every layer
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        rope = self.ops.rope_inputs(positions, x.dtype)
        stack: Any = self.layer_stack(kv_cache) if self.use_layer_stack else None
        if stack is not None:
            out, stream = stack.forward(x, rope[0], rope[1], meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc)
            return cast(torch.Tensor, out + stream)
        residual: torch.Tensor | None = None
        # The layers and their parts are called by .forward, not through nn.Module.__call__,
        # whose hook checks cost ~4 us a call, 7 calls a layer (~0.9 ms of an 11 ms batch-1
        # CPU decode step). Nothing in Jitney registers hooks on them.
        for i, layer in enumerate(self.model.layers):
            self.ops.checking = self.backend.checking = i == 0  # later layers have the same shapes
            x, residual = layer.forward(x, residual, rope, kv_cache.layer(i), meta, self.backend, self.ops)
        self.ops.checking = self.backend.checking = True
        assert residual is not None
        return x + residual

    def layer_stack(self, kv_cache: PagedKVCache) -> torch.ScriptObject | None:
        """The C++ stack of this model's layers over ``kv_cache`` (``cpu_kernels.layer_stack``),
        made on first use: on the CPU's invariant path (``InvariantCpuLayerOps`` and
        ``InvariantCpuAttention``), without tensor parallelism (its all-reduce is
        Python's), with the CPU kernels' linears. None elsewhere: the layers run
        one op at a time. One forward of 30 layers is ~270 op calls from Python
        otherwise: 1.2-1.5 ms of every step on a 2-core CPU (docs/journal/2026-11-27-layer-stack.md)."""
        if self._stack is not None and self._stack[0]() is kv_cache:
            return self._stack[1]
        stack = None
        layers = [cast(DecoderLayer, layer) for layer in self.model.layers]
        if (isinstance(self.ops, InvariantCpuLayerOps) and isinstance(self.backend, InvariantCpuAttention)
                and all(layer.self_attn.reduce is no_reduce and layer.mlp.reduce is no_reduce for layer in layers)):
            from jitney.worker import cpu_kernels

            attn = layers[0].self_attn
            stack = cpu_kernels.layer_stack(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, [
                (layer.input_layernorm.weight, layer.input_layernorm.eps, layer.post_attention_layernorm.weight,
                 layer.post_attention_layernorm.eps, *kv_cache.layer(i),
                 [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj])
                for i, layer in enumerate(layers)])
        self._stack = (weakref.ref(kv_cache), stack)
        return stack

    def __getstate__(self) -> dict[str, object]:
        """A copy (``copy.deepcopy``, pickling) makes its own stack when it first runs."""
        state = dict(self.__dict__)
        state["_stack"] = None
        return state

    def use_backend(self, backend: AttentionBackend, max_positions: int) -> None:
        """Attend with ``backend``; with a graph-safe (Triton) one, also fuse the elementwise ops;
        with the CPU's invariant one, run them through its C++ kernels (``InvariantCpuLayerOps``)."""
        self.backend = backend
        self._stack = None
        if backend.graph_safe:
            from jitney.worker.layer_ops import TritonLayerOps

            self.ops = TritonLayerOps(self.ops.inv_freq, max_positions)
        elif isinstance(backend, InvariantCpuAttention):
            self.ops = InvariantCpuLayerOps(self.ops.inv_freq)
        else:
            self.ops = TorchLayerOps(self.ops.inv_freq)

    def compute_logits(self, hidden: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        """Float32 logits (S, vocab) at rows ``sample_indices (S,)`` of ``hidden``."""
        norm = self.model.norm   # through the layer ops: one fused kernel, as the layers' norms
        x = self.ops.rms_norm(hidden[sample_indices], norm.weight, norm.eps)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight).float()
        return self.lm_head(x).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        """Move weights from an HF-named ``state_dict`` into this model.

        Tensors are popped from ``state_dict`` as they are used, so the two
        never hold the whole model twice. Raises ``ValueError`` on a missing
        tensor or a shape mismatch.
        """
        for name, param in list(self.named_parameters()):
            parts = [state_dict.pop(src).to(device=device, dtype=dtype) for src in _hf_sources(name, state_dict)]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tensor.shape != param.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            prefix, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(prefix), leaf, nn.Parameter(tensor, requires_grad=False))
        self.ops = TorchLayerOps(self.ops.inv_freq.to(device))
        self.eval()


# Fused parameters and the HF tensors they are stacked from (in this order).
_FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _hf_sources(name: str, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """The HF tensor names that make up parameter ``name``; all must exist."""
    prefix, _, leaf = name.rpartition(".")
    sources = [name]
    for fused, parts in _FUSED.items():
        if prefix.endswith(fused):
            base = prefix[: -len(fused)]
            sources = [f"{base}{part}.{leaf}" for part in parts]
    missing = [s for s in sources if s not in state_dict]
    if missing:
        raise ValueError(f"checkpoint lacks {', '.join(missing)}")
    return sources
