"""Any other decoder, through transformers' own modeling code.

A ``*ForCausalLM`` architecture no native family registers (``registry.py``)
runs here: transformers builds it from its config on the meta device, the
checkpoint's HF-named tensors are placed into it, and its decoder runs the
whole fused step as one row (``input_ids (1, T)``, ``position_ids (1, T)``)
with Jitney's paged attention plugged into transformers' attention registry
(``hf_attention.py``). So it batches continuously with the paged KV cache,
prefix caching and preemption like a native family; what differs is that
the work between attention calls (norms, activations, rotary, residuals)
is transformers' torch code, not Jitney's kernels, which is why batch
invariance is not guaranteed here (``ModelRunner.ready_message``).

Refused, with ``UnsupportedModelError`` naming the architecture and what is
missing (``refusal``): encoder-decoders, anything whose layers are not all
attention (recurrent, state-space, hybrid: ``layer_types`` other than
full/sliding attention, attention modules without ``layer_idx`` or fewer of
them than layers), ALiBi, pre-quantized checkpoints, remote code, tensor
parallelism. A layer's sliding window, attention logit soft cap and sinks,
as its transformers module passes them, are the paged backend's own
(``hf_attention._features``). At load a probe
(``_probe``) runs a short prompt in two chunks through the paged path and
through transformers' eager attention and refuses the model when the
logits differ: what the checks above cannot see (positions taken from
elsewhere than ``position_ids``, a mask the model builds itself, logits
post-processing this file does not know) is caught before the worker is ready.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata, TorchPagedAttention
from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache
from jitney.worker.layers.linear import NO_SHARD, Loaded, Shard, whole
from jitney.worker.layers.linear_kernel import LinearKernel
from jitney.worker.layers.reduce import Reduce, no_reduce
from jitney.worker.models import hf_attention, hf_weights
from jitney.worker.models.config import ModelConfig, UnsupportedModelError
from jitney.worker.models.hf_attention import ATTENTION_KEY, PagedStep

logger = logging.getLogger("jitney.worker")

FAMILY = "transformers"    # (registry.family_for picks it by ``refusal``, for any unregistered *ForCausalLM)

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
PROBE_CHUNKS = (5, 3)          # the probe's prompt, as two chunks (the second starts mid-block)
PROBE_BLOCK = 4


def architecture(hf: Any) -> str | None:
    """The config's first ``*ForCausalLM`` architecture."""
    return next((a for a in getattr(hf, "architectures", None) or [] if a.endswith("ForCausalLM")), None)


def refusal(hf: Any) -> str | None:
    """Why transformers' code for ``hf`` cannot run on Jitney's paged attention
    (a reason, to follow the model's name), or None."""
    arch = architecture(hf)
    if getattr(hf, "is_encoder_decoder", False):
        return "it is an encoder-decoder; Jitney runs decoder-only models"
    if arch is None:
        return "the transformers fallback runs only *ForCausalLM architectures"
    import transformers

    if not hasattr(transformers, arch):
        if getattr(hf, "auto_map", None):
            return f"{arch} needs the checkpoint's own code (auto_map), which Jitney does not run"
        return f"transformers {transformers.__version__} has no {arch}"
    text = hf.get_text_config()
    kinds = sorted(set(getattr(text, "layer_types", None) or []) - set(ATTENTION_LAYER_TYPES))
    if kinds:
        return f"it has layers of type {', '.join(kinds)}; only attention layers are supported"
    return _context_problem(text) or _feature_problem(hf, text)


def _context_problem(text: Any) -> str | None:
    if getattr(text, "max_position_embeddings", None) is None:
        return "its config has no max_position_embeddings (the context length)"
    return None


def _feature_problem(hf: Any, text: Any) -> str | None:
    if getattr(text, "alibi", False) or getattr(getattr(text, "attn_config", None), "alibi", False):
        return "ALiBi position biases are not supported"
    if getattr(hf, "quantization_config", None):
        return "pre-quantized checkpoints are not supported (use --quantization on a full-precision one)"
    if getattr(text, "is_causal", True) is False:
        return "non-causal attention is not supported"
    return None


def config_from_hf(hf: Any) -> ModelConfig:
    """The fallback's ``ModelConfig``: the cache geometry, and the HF config itself as JSON
    (``CausalLM`` rebuilds the model from it; the weights cache keeps it)."""
    problem = refusal(hf)
    if problem:
        raise UnsupportedModelError(f"{architecture(hf) or hf.model_type}: {problem}")
    _attention_layers(_build(hf))   # refuses a model whose attention modules do not line up with its layers
    text = hf.get_text_config()
    heads = int(text.num_attention_heads)
    return ModelConfig(
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 0),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 0.0),
        rope_theta=0.0,    # (transformers' own rotary runs; nothing of Jitney's reads it)
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        family=FAMILY,
        hf_config=hf.to_json_string(use_diff=True),
    )


def _hf_config(cfg: ModelConfig) -> Any:
    from transformers import CONFIG_MAPPING

    data = json.loads(cfg.hf_config)
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def _build(hf: Any) -> Any:
    """transformers' model of ``hf`` on the meta device, attending through ``ATTENTION_KEY``."""
    import transformers
    from transformers.initialization import no_init_weights

    arch = architecture(hf)
    assert arch is not None
    hf_attention.register()
    try:
        with torch.device("meta"), no_init_weights():
            model = getattr(transformers, arch)._from_config(hf, attn_implementation=ATTENTION_KEY)
    except KeyError as err:    # (an attention class per implementation name, not the attention interface)
        raise UnsupportedModelError(f"{arch} picks its attention classes by name ({err}), not through "
                                    "transformers' attention interface") from err
    except (ValueError, TypeError, AttributeError, NotImplementedError) as err:
        raise UnsupportedModelError(f"transformers cannot build {arch} with Jitney's attention: {err}") from err
    # Some such models swap the requested implementation for their own (Falcon's
    # _check_and_enable_sdpa sets "sdpa" where transformers asks it to): built so, their
    # layers would attend without the paged cache.
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != ATTENTION_KEY:
        raise UnsupportedModelError(f"{arch} picks its attention classes by name (transformers built it with "
                                    f"{implementation!r}), not through transformers' attention interface")
    return model


def _attention_layers(model: Any) -> list[int]:
    """The ``layer_idx`` of every attention module, checked to be each layer once."""
    arch = type(model).__name__
    attention = [m for m in model.modules() if "Attention" in type(m).__name__ and not isinstance(m, nn.ModuleList)
                 and any(isinstance(c, nn.Linear) for c in m.children())]
    missing = sorted({type(m).__name__ for m in attention if getattr(m, "layer_idx", None) is None})
    if missing or not attention:
        raise UnsupportedModelError(f"{arch}: {', '.join(missing) or 'no attention module'} has no layer_idx "
                                    "(Jitney's paged attention finds a layer's cache by it)")
    layers = sorted(int(m.layer_idx) for m in attention)
    expected = list(range(int(model.config.get_text_config().num_hidden_layers)))
    if layers != expected:
        raise UnsupportedModelError(f"{arch}: attention modules for layers {layers}, but the model has "
                                    f"{len(expected)} layers; only models whose every layer is one attention "
                                    "layer are supported")
    return layers


class CausalLM(nn.Module):
    """transformers' decoder over the paged cache, with the interface of ``llama.CausalLM``.
    Build it on the meta device, then ``load_weights`` (which also probes it)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, *,
                 reduce: Reduce = no_reduce, shard: Shard = NO_SHARD, kernel: LinearKernel = LinearKernel()) -> None:
        super().__init__()
        if reduce is not no_reduce or shard.size > 1:
            raise UnsupportedModelError("tensor parallelism is not supported on the transformers path")
        self.kernel = kernel
        hf = _build(_hf_config(cfg))
        self.config = cfg
        self.architecture = type(hf).__name__
        self.backend = backend if backend is not None else TorchPagedAttention()
        self.model: Any = hf.base_model           # the decoder (HF's ``model.``); its output is normed
        self.lm_head: nn.Module | None = hf.get_output_embeddings()
        text = hf.config.get_text_config()
        self.logit_scale = float(getattr(text, "logit_scale", None) or 1.0)            # Cohere
        self.logits_scaling = float(getattr(text, "logits_scaling", None) or 1.0)      # Granite
        self.softcap = getattr(text, "final_logit_softcapping", None)                  # Gemma 2's kind
        self.max_window = int(text.max_position_embeddings)
        # The layer ops and the one-call C++ stack are the native families'; here every step
        # runs transformers' modules.
        self.ops: Any = None
        self.use_layer_stack = False
        self._unloaded: tuple[Any, ...] | None = (hf,)   # the whole HF model, until load_weights

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVCache) -> torch.Tensor:
        """Hidden states (T, hidden) of the step's flattened tokens (T,), after the final norm."""
        return self._run(input_ids, positions, self.backend.prepare(meta), kv_cache, self.backend)[0]

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             kv_cache: PagedKVCache, backend: AttentionBackend) -> tuple[torch.Tensor, list[int]]:
        step = PagedStep(meta, kv_cache, backend, self.max_window)
        try:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                             jitney_step=step)
        finally:
            backend.checking = True
        return out.last_hidden_state[0], step.attended

    def compute_logits(self, hidden: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
        """Float32 logits (S, vocab) at rows ``sample_indices (S,)`` of ``hidden``."""
        assert self.lm_head is not None
        logits = self.lm_head(hidden[sample_indices]).float()
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def use_backend(self, backend: AttentionBackend, max_positions: int) -> None:
        """Attend with ``backend`` (the elementwise work stays transformers')."""
        self.backend = backend

    def layer_stack(self, kv_cache: PagedKVCache) -> None:
        """No one-call C++ stack on this path: transformers' layers run one module at a time."""
        return None

    def load_weights(self, tensors: Iterable[tuple[str, Loaded]], dtype: torch.dtype,
                     device: torch.device) -> list[str]:
        """Place the checkpoint's HF-named tensors, tie the embeddings as the config says,
        compute the non-persistent buffers (rotary frequencies), probe the model
        (``_probe``), then put its linears on its kernel. Returns the names no parameter
        took. Raises ``ValueError`` on a missing tensor or a shape mismatch,
        ``UnsupportedModelError`` when the probe fails."""
        assert self._unloaded is not None, "load_weights runs once"
        state_dict = {name: whole(loaded) for name, loaded in tensors}
        hf = self._unloaded[0]
        started = time.perf_counter()
        hf_weights.rename_checkpoint_keys(hf, state_dict)
        hf_weights.place_tensors(hf, state_dict, dtype, device)
        hf.tie_weights()
        hf_weights.init_buffers(hf, device)
        hf.eval()
        self.lm_head = hf.get_output_embeddings()
        if not isinstance(self.lm_head, nn.Linear):
            raise UnsupportedModelError(f"{self.architecture}: its output embeddings are a "
                                        f"{type(self.lm_head).__name__}, not a linear layer")
        self._probe(hf, dtype, device)
        hf_attention.wrap_linears(self.model)     # Jitney's kernels take 2-D input (LinearKernel.apply)
        self._unloaded = None                     # (its lm_head would outlive a swapped head)
        head = cast(nn.Linear, self.lm_head)
        kernel_head = self.kernel.apply(self.model, head.weight, head.bias)
        if kernel_head is not None:
            self.lm_head = kernel_head
        logger.info("transformers path: %s placed and probed in %.2f s", self.architecture,
                    time.perf_counter() - started)
        return list(state_dict)

    @torch.inference_mode()
    def _probe(self, hf: Any, dtype: torch.dtype, device: torch.device) -> None:
        """A short prompt in two chunks through the paged path against transformers' own
        eager forward of it: the same logits, or the model is refused."""
        cfg = self.config
        total = sum(PROBE_CHUNKS)
        ids = (torch.arange(total, device=device) * 7919 + 3) % cfg.vocab_size
        geometry = CacheGeometry(cfg.num_layers, PROBE_BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype)
        table = [2, 0, 1]                          # scattered blocks
        cache = PagedKVCache(geometry, len(table), device)
        backend = TorchPagedAttention()
        got, start = [], 0
        try:
            for n in PROBE_CHUNKS:
                meta = backend.prepare(AttentionMetadata.build(query_lens=[n], seq_lens=[start + n],
                                                               block_tables=[table], block_size=PROBE_BLOCK,
                                                               device=device))
                hidden, attended = self._run(ids[start:start + n], torch.arange(start, start + n, device=device),
                                             meta, cache, backend)
                if attended != list(range(cfg.num_layers)):
                    raise UnsupportedModelError(f"{self.architecture}: layers {attended} of {cfg.num_layers} went "
                                                "through Jitney's paged attention; only models whose every "
                                                "layer attends through transformers' attention interface run")
                got.append(self.compute_logits(hidden, torch.arange(n, device=device)))
                start += n
            hf.set_attn_implementation("eager")
            try:
                want = hf(input_ids=ids[None], use_cache=False).logits[0].float()
            finally:
                hf.set_attn_implementation(ATTENTION_KEY)
        except (UnsupportedModelError, MemoryError, torch.OutOfMemoryError):
            raise
        except hf_attention.StepNotPassed as err:
            raise UnsupportedModelError(f"{self.architecture}: {err}") from err
        except Exception as err:   # transformers' code does not run this way: the model cannot be served
            raise UnsupportedModelError(f"{self.architecture} does not run on Jitney's paged attention "
                                        f"({type(err).__name__}: {err})") from err
        _compare(self.architecture, torch.cat(got), want, dtype)


def _compare(arch: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # Two orders of the same sums: float32 agrees to ~1e-6 of the logits' scale, half
    # precision to a few of its 8 mantissa bits; a missing feature is off by far more.
    scale = max(1.0, float(want.abs().max()))
    tolerance = (1e-3 if dtype == torch.float32 else 5e-2) * scale
    diff = float((got - want).abs().max())
    if not diff <= tolerance:
        raise UnsupportedModelError(
            f"{arch}: through Jitney's paged attention its logits differ from transformers' own by {diff:.3g} "
            f"(more than {tolerance:.3g}): the model does something this path does not reproduce")
