"""The Llama family (Llama, Mistral, Qwen2, SmolLM): its config from Hugging Face's, its decoder layer and model.

Its parts live in ``worker/layers`` (RMSNorm, rotary frequencies, attention over the
paged cache, the SwiGLU MLP); here: decoder layer, model. The forward pass takes the
flattened tokens of a whole fused step; logits are computed separately and
only at the positions that sample. The elementwise work between the matmuls
(norms with their residual adds, rotary + cache write, SiLU * up) goes
through ``layer_ops``: C++ kernels on the CPU's batch-invariant path
(``csrc/elementwise.cpp``), plain torch on ``--no-batch-invariant``'s, fused
Triton kernels with the Triton attention backend.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
fused into one matmul each (``qkv_proj``, ``gate_up_proj``; ``STACKED`` names
the checkpoint tensors they load from, ``models/weights.py``).

Tensor parallelism: a rank's model is built from its local config (its
heads, its share of the MLP, ``sharding.local_config``), its ``Shard`` (each
linear loads its own part of a checkpoint tensor, ``layers/linear.py``) and a
``reduce`` that sums a row-parallel output over the ranks (an all-reduce); it
is called after o_proj and after down_proj, and is the identity without a group.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata, InvariantCpuAttention, TorchPagedAttention
from jitney.worker.attention.kv_cache import PagedKVCache
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.kernels.cpu.ops import RoutedExperts, StackLayer
from jitney.worker.layers.attention import Attention
from jitney.worker.layers.linear import NO_SHARD, Loaded, Shard
from jitney.worker.layers.linear_kernel import LinearKernel
from jitney.worker.layers.lora import LoraSlots, LoraTarget
from jitney.worker.layers.mlp import MLP
from jitney.worker.layers.moe import FusedExperts, SparseMoe
from jitney.worker.layers.norm import RMSNorm
from jitney.worker.layers import program
from jitney.worker.layers.ops import InvariantCpuLayerOps, TorchLayerOps
from jitney.worker.layers.program import Op, Program, check_program
from jitney.worker.layers.reduce import Reduce, no_reduce
from jitney.worker.layers.rotary import rotary_for
from jitney.worker.models.config import ModelConfig, UnsupportedModelError, rope_from_hf
from jitney.worker.models.weights import Stacked, load_checkpoint

logger = logging.getLogger("jitney.worker")


# The Hugging Face architectures this file runs (models/registry.py), and their model types
# (a config read from a GGUF file may name no architecture).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPES = ("llama", "mistral", "qwen2")

# The checkpoint tensors the fused layers load from, and which part of each they are.
STACKED: Stacked = (
    (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
)


def config_from_hf(hf: Any, family: str = "llama") -> ModelConfig:
    """Translate a transformers config of this family (or of ``family``, one built on
    it), refusing what it cannot run."""
    model_type = hf.model_type
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf.hidden_act!r} is not supported (only silu)")
    theta, scaling = rope_from_hf(hf)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    layer_types, window = _layer_windows(hf)
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias
        # puts a bias on all four.
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type == "llama" and attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        family=family,
        layer_types=layer_types,
        sliding_window=window,
    )


def _layer_windows(hf: Any) -> tuple[tuple[str, ...], int]:
    """Each layer's attention type and the sliding layers' window, as transformers
    applies them: every layer when the config has a ``sliding_window`` and no
    ``layer_types`` (Mistral, Phi-3); the sliding ``layer_types`` otherwise
    (Qwen2 with ``use_sliding_window``: from ``max_window_layers`` on). No
    window: ``((), 0)``."""
    window = int(getattr(hf, "sliding_window", None) or 0)
    if not window:
        return (), 0
    types = tuple(getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers)
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != hf.num_hidden_layers:
        raise UnsupportedModelError(f"layer_types {sorted(set(types))} ({len(types)} of {hf.num_hidden_layers} "
                                    "layers) are not supported (sliding_attention, full_attention)")
    return (types, window) if "sliding_attention" in types else ((), 0)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP, as a layer program
    (``layers/program.py``) run op by op here or by the CPU's C++ stack.

        # layer in:  x = previous MLP output (or the embeddings), residual = stream so far (None at layer 0)
        # layer out: x = this MLP's output,                    residual = stream before that output
    """

    # norms: input_layernorm, post_attention_layernorm; linears: qkv, o, gate_up, down
    PROGRAM: Program = (
        (Op.INPUT_NORM, 0),
        (Op.LINEAR, 0), (Op.ROPE_CACHE, 0), (Op.ATTEND, 0), (Op.LINEAR, 1), (Op.REDUCE, 0),
        (Op.ADD_NORM, 1),
        (Op.LINEAR, 2), (Op.SILU_MUL, 0), (Op.LINEAR, 3), (Op.REDUCE, 0),
    )

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce, shard: Shard = NO_SHARD, index: int = 0) -> None:
        super().__init__()
        self.reduce, self.shard, self.index = reduce, shard, index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, shard=shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, shard=shard)
        self.attend: dict[str, Any] = {}   # this layer's attention features (program.py's ATTEND)
        self.rope = 0   # which of the model's rotary tables (CausalLM.layer_ops) it rotates by
        if cfg.sliding_window and cfg.layer_types and cfg.layer_types[index] == "sliding_attention":
            self.attend["window"] = cfg.sliding_window
        self.add_parts(cfg)
        # run() indexes norms and linears without checks: the program is checked once, here
        check_program(self.PROGRAM, len(self.norms()), len(self.linears()))

    def add_parts(self, cfg: ModelConfig) -> None:
        """A family built on this layer adds its own parts here (before the program is checked)."""

    def norms(self) -> list[RMSNorm]:
        return [self.input_layernorm, self.post_attention_layernorm]

    def linears(self) -> list[nn.Module]:
        """The program's linears, as they are now (a kernel's linear once loaded)."""
        attn, mlp = self.self_attn, self.mlp
        return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: TorchLayerOps,
        lora: LoraSlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        adapters = (lora, self.index, meta.lora_slots) if lora is not None and meta.lora_slots is not None else None
        return program.run(self.PROGRAM, self.norms(), self.linears(), x, residual, rope, kv, meta, backend, ops,
                           attn.heads, attn.scale, self.reduce, self.attend, adapters)

    def lora_targets(self, cfg: ModelConfig) -> list[LoraTarget]:
        """The linears an adapter may target, by PEFT name (``layers/lora.py``): q/k/v as
        slices of ``qkv_proj`` (Phi-3's checkpoints name the fused ``qkv_proj`` and
        ``gate_up_proj`` themselves), o_proj, and the MLP's unless it is an experts block."""
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = cfg.family == "phi3"
        targets = ([LoraTarget("qkv_proj", 0, 0, h, q + 2 * kv)] if fused else
                   [LoraTarget("q_proj", 0, 0, h, q), LoraTarget("k_proj", 0, q, h, kv),
                    LoraTarget("v_proj", 0, q + kv, h, kv)])
        targets.append(LoraTarget("o_proj", 1, 0, q, h))
        if isinstance(self.mlp, MLP) and len(self.linears()) == 4:
            targets += ([LoraTarget("gate_up_proj", 2, 0, h, 2 * inter)] if fused else
                        [LoraTarget("gate_proj", 2, 0, h, inter), LoraTarget("up_proj", 2, inter, h, inter)])
            targets.append(LoraTarget("down_proj", 3, 0, inter, h))
        return targets

    def stack_layer(self, kv: tuple[torch.Tensor, torch.Tensor], lora: LoraSlots | None = None) -> StackLayer | None:
        """This layer over its cache ``kv`` for the C++ stack (``cpu_kernels.layer_stack``),
        with its targets of ``lora``'s adapter slots; None when a part of it is not on the
        CPU's kernels (an experts block elsewhere)."""
        linears: list[nn.Module | RoutedExperts] = []
        for linear in self.linears():
            part = linear.cpu_parts() if isinstance(linear, SparseMoe) else linear
            if part is None:
                return None
            linears.append(part)
        targets = [cpu_kernels.StackLora(*t) for t in lora.stack_targets(self.index)] if lora is not None else []
        return cpu_kernels.StackLayer(self.PROGRAM, [(norm.weight, norm.eps) for norm in self.norms()], kv[0], kv[1],
                                      linears, self.rope, **self.attend, lora=targets)


class Decoder(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.``), of the family's ``layer`` class."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce, shard: Shard = NO_SHARD,
                 layer: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        # Given an empty weight, the embedding skips its random init: on the meta
        # device, normal_ would import sympy (~1.5 s of a restarted worker's start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layer(cfg, reduce, shard, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model. Build it on the meta device, then ``load_weights``.

    Under tensor parallelism ``cfg`` is the rank's local config
    (``sharding.local_config``), ``shard`` the rank and ``reduce`` the group's
    all-reduce. ``kernel``: what the linears run on once loaded (``layers/linear_kernel.py``).
    A family built on this one names its decoder layer (``LAYER``) and its fused
    tensors (``STACKED``).
    """

    LAYER: type[DecoderLayer] = DecoderLayer
    STACKED: Stacked = STACKED
    # Whether the CPU's C++ layer stack can hold the layers (every op of layers/program.py,
    # attention's features and layers/moe.py's experts blocks; a family whose layers hold
    # anything else says False and runs op by op).
    STACKABLE = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, *,
                 reduce: Reduce = no_reduce, shard: Shard = NO_SHARD, kernel: LinearKernel = LinearKernel()) -> None:
        super().__init__()
        self.config = cfg
        self.kernel = kernel
        self.backend = backend if backend is not None else TorchPagedAttention()
        self.model = Decoder(cfg, reduce, shard, self.LAYER)
        # The elementwise work between matmuls; ``use_backend`` picks the fused ops for Triton.
        self.ops = TorchLayerOps(rotary_for(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        # None: tied to the embedding (until a packed copy takes its place).
        self.lm_head: nn.Module | None = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # The CPU's invariant path runs its layers as one C++ call (``layer_stack``) unless this
        # is False (tests compare the two; benchmarks measure them side by side).
        self.use_layer_stack = True
        # (the cache it was made over, weakly: a model does not keep a cache alive; the stack)
        self._stack: tuple[weakref.ref[PagedKVCache], torch.ScriptObject | None] | None = None
        self.lora: LoraSlots | None = None   # adapter slots (``use_lora``); None: LoRA off

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
        x = self.embed(input_ids)  # (T, hidden)
        layer_ops = self.layer_ops()
        ropes = [ops.rope_inputs(positions, x.dtype) for ops in layer_ops]   # once per step, per table
        adapters = self.lora if meta.lora_slots is not None else None
        stack: Any = self.layer_stack(kv_cache) if self.use_layer_stack else None
        if stack is not None:
            out, stream = stack.forward(x, [rope[0] for rope in ropes], [rope[1] for rope in ropes],
                                        meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        meta.lora_slots if adapters is not None else None)
            return cast(torch.Tensor, out + stream)
        residual: torch.Tensor | None = None
        checked: set[int] = set()
        # The layers and their parts are called by .forward, not through nn.Module.__call__,
        # whose hook checks cost ~4 us a call, 7 calls a layer (~0.9 ms of an 11 ms batch-1
        # CPU decode step). Nothing in Jitney registers hooks on them.
        for i, module in enumerate(self.model.layers):
            layer = cast(DecoderLayer, module)
            ops = layer_ops[layer.rope]
            # the first layer of each rotary table checks its arguments: later ones have the same shapes
            ops.checking = self.backend.checking = layer.rope not in checked
            checked.add(layer.rope)
            x, residual = layer.forward(x, residual, ropes[layer.rope], kv_cache.layer(i), meta, self.backend, ops,
                                        adapters)
        for ops in layer_ops:
            ops.checking = True
        self.backend.checking = True
        assert residual is not None
        return x + residual

    def use_lora(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> LoraSlots:
        """Give the model ``max_loras`` adapter slots of rank ``max_rank`` (``layers/lora.py``)
        over the linears every layer offers."""
        layers = [cast(DecoderLayer, layer) for layer in self.model.layers]
        offered = [{t.name: t for t in layer.lora_targets(self.config)} for layer in layers]
        common = [t for name, t in offered[0].items() if all(o.get(name) == t for o in offered)]
        self.lora = LoraSlots(common, len(layers), max_loras, max_rank, dtype, device)
        self._stack = None   # (a stack made before holds no targets)
        return self.lora

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings (T, hidden) of ``input_ids (T,)``, as the first layer takes them."""
        x: torch.Tensor = self.model.embed_tokens(input_ids)
        return x

    def layer_ops(self) -> list[TorchLayerOps]:
        """The layer ops of each rotary table, in the order a layer's ``rope`` names them:
        the model's one here."""
        return [self.ops]

    def layer_stack(self, kv_cache: PagedKVCache) -> torch.ScriptObject | None:
        """The C++ stack of this model's layers over ``kv_cache`` (``cpu_kernels.layer_stack``),
        with the adapter slots' targets (``use_lora``), made on first use: on the CPU's
        invariant path (``InvariantCpuLayerOps`` and
        ``InvariantCpuAttention``), without tensor parallelism (its all-reduce is
        Python's), with the CPU kernels' linears. None elsewhere: the layers run
        one op at a time. One forward of 30 layers is ~270 op calls from Python
        otherwise: 1.2-1.5 ms of every step on a 2-core CPU (docs/journal/2026-11-27-layer-stack.md)."""
        if self._stack is not None and self._stack[0]() is kv_cache:
            return self._stack[1]
        stack = None
        layers = [cast(DecoderLayer, layer) for layer in self.model.layers]
        attn = layers[0].self_attn
        if (self.STACKABLE and all(isinstance(ops, InvariantCpuLayerOps) for ops in self.layer_ops())
                and isinstance(self.backend, InvariantCpuAttention)
                and all(layer.reduce is no_reduce and layer.self_attn.scale == attn.scale for layer in layers)):
            parts = [layer.stack_layer(kv_cache.layer(i), self.lora) for i, layer in enumerate(layers)]
            if all(part is not None for part in parts):
                stack = cpu_kernels.layer_stack(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                                                cast(list[StackLayer], parts))
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
            from jitney.worker.layers.ops import TritonLayerOps

            self.ops = TritonLayerOps(self.ops.rotary, max_positions)
        elif isinstance(backend, InvariantCpuAttention):
            self.ops = InvariantCpuLayerOps(self.ops.rotary)
        else:
            self.ops = TorchLayerOps(self.ops.rotary)

    def compute_logits(self, hidden: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        """Float32 logits (S, vocab) at rows ``sample_indices (S,)`` of ``hidden``."""
        norm = self.model.norm   # through the layer ops: one fused kernel, as the layers' norms
        x = self.ops.rms_norm(hidden[sample_indices], norm.weight, norm.eps)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight).float()
        return self.lm_head(x).float()

    def rename(self, name: str) -> tuple[str, object] | None:
        """A family's own checkpoint names (``models/weights.py``'s ``Rename``); none here."""
        return None

    def load_weights(self, tensors: Iterable[tuple[str, Loaded]], dtype: torch.dtype,
                     device: torch.device) -> list[str]:
        """Fill this model (built on the meta device) from HF-named checkpoint tensors,
        then put its linears on its kernel. Returns the names no parameter took;
        raises ``ValueError`` on a missing tensor or a shape mismatch."""
        unused = load_checkpoint(self, tensors, self.STACKED, dtype, device, self.rename)
        self.ops = TorchLayerOps(self.ops.rotary.to(device))
        head = self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else self.model.embed_tokens.weight
        kernel_head = self.kernel.apply(self.model, head)
        if kernel_head is not None:
            self.lm_head = kernel_head
        self._use_experts_kernel(device)
        self.eval()
        return unused

    def _use_experts_kernel(self, device: torch.device) -> None:
        """Put the MoE layers' experts (layers/moe.py) on the device's own kernel."""
        for module in self.modules():
            if not isinstance(module, FusedExperts):
                continue
            if device.type == "cpu":
                module.use_cpu_kernel()
            elif device.type == "cuda" and not module.use_triton_kernel():
                logger.warning("the triton package is missing: the experts run a torch loop over "
                               "the routed experts (slower; pip install triton)")
                return
