"""Load a Llama-family model's config and weights through transformers.

Two sources: a Hugging Face folder (``config.json`` + ``*.safetensors``) or a
GGUF file (de-quantised by transformers' GGUF reader). Never pickle: ``.bin``
checkpoints are refused. The tokenizer is not loaded here unless the config
names no end-of-sequence token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from jitney.common.model_files import ModelFiles, load_tokenizer, resolve_model
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.attention.backends import BackendUnavailableError
from jitney.worker.kernels.cpu.packed import PackedLinear, pack_linears, packing_supported
from jitney.worker.layers.reduce import Reduce, no_reduce
from jitney.worker.models.config import ModelConfig, ModelFacts, UnsupportedModelError
from jitney.worker.models.registry import ServedModel, family_for, family_named
from jitney.worker.distributed.sharding import Shard, check_shardable, local_config, read_safetensors, shard_state_dict
from jitney.worker.loading.weights_cache import WeightsCache

logger = logging.getLogger("jitney.worker")

def load_hf_config(files: ModelFiles) -> Any:
    """The transformers config of the model, read offline."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(files.directory), local_files_only=True, **files.pretrained_kwargs())


def model_config_from_hf(hf: Any) -> ModelConfig:
    """The config of the family that runs ``hf`` (``models/registry.py``), refusing what none can run."""
    return family_for(hf).config_from_hf(hf)


def model_facts(files: ModelFiles, hf: Any, max_model_len: int | None) -> ModelFacts:
    """Name, vocabulary size, context length and EOS ids of the model."""
    return cap_context(source_facts(files, hf), max_model_len)


def source_facts(files: ModelFiles, hf: Any) -> ModelFacts:
    """The model's facts as its files state them (no ``--max-model-len`` cap)."""
    context = int(hf.max_position_embeddings)
    window = getattr(hf, "sliding_window", None)
    if window and (hf.model_type == "mistral" or getattr(hf, "use_sliding_window", False)):
        # Capping the context at the window makes windowed attention exact
        # without implementing it.
        context = min(context, int(window))
    return ModelFacts(
        name=files.name,
        vocab_size=int(hf.vocab_size),
        context_length=context,
        eos_token_ids=_eos_token_ids(files, hf),
    )


def cap_context(facts: ModelFacts, max_model_len: int | None) -> ModelFacts:
    if max_model_len is None:
        return facts
    if max_model_len > facts.context_length:
        logger.warning("max_model_len %d exceeds the model's %d; using %d",
                       max_model_len, facts.context_length, facts.context_length)
    return replace(facts, context_length=min(facts.context_length, max_model_len))


def _eos_token_ids(files: ModelFiles, hf: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (hf, _generation_config(files)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for token in [value] if isinstance(value, int) else (value or []):
            if token not in ids:
                ids.append(int(token))
    if not ids:
        # Slow path (a GGUF tokenizer conversion takes seconds): only when
        # neither config names an EOS token.
        eos = load_tokenizer(files).eos_token_id
        ids = [int(eos)] if eos is not None else []
    return tuple(ids)


def _generation_config(files: ModelFiles) -> Any:
    if files.gguf_file is not None or not (files.directory / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(files.directory), local_files_only=True)


def load_state_dict(files: ModelFiles, hf: Any, dtype: torch.dtype, cfg: ModelConfig,
                    shard: Shard | None = None) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of the checkpoint (GGUF ones de-quantised to ``dtype``);
    with ``shard``, that tensor-parallel rank's parts (``sharding.py``): a
    safetensors folder's are read alone, a GGUF file is de-quantised whole and cut."""
    if files.gguf_file is not None:
        converted = _load_gguf_tensors(files.directory / files.gguf_file, hf, dtype)
        if shard is not None and shard.size > 1:
            shard_state_dict(converted, cfg, shard)
        return converted
    paths = sorted(files.directory.glob("*.safetensors"))
    if not paths:
        raise UnsupportedModelError(f"{files.directory} has no *.safetensors (pickled .bin files are refused)")
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        state.update(read_safetensors(path, cfg, shard))
    return state


class _ParameterNames:
    """Stands in for the HF model in transformers' GGUF name mapping.

    ``get_gguf_hf_weights_map`` walks every submodule and rebuilds gguf's
    name table at each one (~4.5 s for a 30-layer model); the top level alone
    already yields every name, so this view exposes no children.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._model.state_dict()

    def named_children(self) -> list[tuple[str, torch.nn.Module]]:
        return []


def _load_gguf_tensors(path: Path, hf: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names = _ParameterNames(AutoModelForCausalLM.from_config(hf))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names, torch_dtype=dtype)
    return parsed["tensors"]


def _swap_linears(net: ServedModel, dtype: torch.dtype, device: torch.device, batch_invariant: bool,
                  quantization: str = "none") -> None:
    """The linear layers and the logits' head (its own weight, or the tied
    embedding's) through the device's kernel:

    - ``quantization`` int8 (the CPU): ``cpu_kernels.Int8Linear``, int8
      weights quantized here, batch-invariant whatever ``batch_invariant``;
      int4: ``cpu_kernels.Int4Linear`` for the linear layers, the head int8;

    - ``batch_invariant`` on CUDA: the Triton matmul (``triton_matmul.py``);
    - ``batch_invariant`` on the CPU: ``cpu_kernels.InvariantLinear``, the head
      with float32 output;
    - else bf16 on the CPU: weights packed for oneDNN, whose rounding depends
      on the number of rows; else torch's ``nn.Linear``.
    """
    head = net.lm_head.weight if isinstance(net.lm_head, torch.nn.Linear) else net.model.embed_tokens.weight
    head_bias = getattr(net.lm_head, "bias", None)   # (a transformers-path model's head may have one)
    if quantization in ("int8", "int4"):
        if device.type != "cpu":
            raise ValueError(f"--quantization {quantization} runs on the CPU only")
        names = {"amx": "AMX-INT8", "vnni": "AVX-512 VNNI", "portable": "the portable loops"}
        head_where = names[cpu_kernels.int8_path()]
        if quantization == "int8":
            count = cpu_kernels.use_int8_linears(net.model)
            where = head_where
        else:
            count = cpu_kernels.use_int4_linears(net.model)
            path = cpu_kernels.int4_path()
            where = "AVX-512 VNNI (up to 4 rows) and AMX-INT8 (more)" if path == "amx" else names[path]
        # The head stays int8 under int4 too: with an int4 head, perplexity rose to 22.4 against
        # 19.0 (bench/quant_accuracy.py; README "int4 weights").
        net.lm_head = cpu_kernels.Int8Linear(head, head_bias, out_float=True)
        if "portable" not in where + head_where:
            logger.info("%s weights: %d linear layers run on %s, the int8 head on %s", quantization, count, where,
                        head_where)
        else:
            logger.warning("%s weights: %d linear layers run on %s, the int8 head on %s: this CPU lacks AMX-INT8 "
                           "and AVX-512 VNNI, and the portable loops are much slower than --quantization none "
                           "(same results)", quantization, count, where, head_where)
    elif batch_invariant and device.type == "cuda":
        try:
            from jitney.worker.kernels.triton import matmul as triton_matmul
        except ImportError as err:
            raise BackendUnavailableError("--batch-invariant on CUDA needs the triton package "
                                          "(pip install triton)") from err
        count = triton_matmul.use_invariant_linears(net.model)
        net.lm_head = triton_matmul.TritonInvariantLinear(head, head_bias)
        logger.info("batch-invariant: %d linear layers and the head run the Triton matmul", count)
    elif batch_invariant and cpu_kernels.supported(dtype, device):
        count = cpu_kernels.use_invariant_linears(net.model)
        net.lm_head = cpu_kernels.InvariantLinear(head, head_bias, out_float=True)
        logger.info("batch-invariant: %d linear layers and the head run the CPU kernel", count)
    elif packing_supported(dtype, device):
        count = pack_linears(net.model)
        net.lm_head = PackedLinear(head, head_bias)
        logger.info("packed %d linear layers and the head for oneDNN (bf16 on the CPU)", count)


def load_model(
    model: str | None, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
    *, batch_invariant: bool = False, quantization: str = "none", weights_cache: WeightsCache | None = None,
    shard: Shard | None = None, reduce: Reduce = no_reduce,
) -> tuple[ServedModel, ModelFacts]:
    """Load ``model`` (path or ``None`` = bundled default) ready to run.

    ``batch_invariant`` swaps the linear layers for batch-invariant ones,
    ``quantization`` int8 for int8 ones (``_swap_linears``). With a ``weights_cache``, the config, the facts and
    (for GGUF) the converted tensors come from its entry for these files and
    this dtype, and a miss writes the entry (``weights_cache.py``).
    ``shard``: a tensor-parallel rank's model (its local config and weights,
    ``sharding.py``), whose row-parallel layers sum over the group with ``reduce``;
    a model whose heads or MLP do not split ``shard.size`` ways raises ``ValueError``.
    """
    started = time.perf_counter()
    files = resolve_model(model)
    split = shard if shard is not None and shard.size > 1 else None
    cached = weights_cache.read(files, dtype, split) if weights_cache is not None else None
    if cached is not None:
        cfg, facts = cached.config, cached.facts
        if split is not None:
            check_shardable(cfg, split.size)
        config_done = time.perf_counter()
        state = cached.state if cached.state is not None else load_state_dict(files, None, dtype, cfg, split)
        source = f"weights cache {weights_cache.root if weights_cache else ''}"
    else:
        hf = load_hf_config(files)
        cfg = model_config_from_hf(hf)
        facts = source_facts(files, hf)
        if split is not None:
            check_shardable(cfg, split.size)
        config_done = time.perf_counter()
        # The cache keeps whole tensors: a GGUF rank converts all of it before cutting its part.
        state = load_state_dict(files, hf, dtype, cfg, None if files.gguf_file is not None else split)
        source = "source files"
        if weights_cache is not None:
            kept = state if files.gguf_file is not None else None
            written = weights_cache.write(files, dtype, cfg, facts, kept)
            if written is not None:
                logger.info("wrote the converted model to the weights cache (%s)", written)
        if split is not None and files.gguf_file is not None:
            shard_state_dict(state, cfg, split)
    facts = cap_context(facts, max_model_len)
    read_done = time.perf_counter()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some checkpoints store the tied copy
    state.pop("model.rotary_emb.inv_freq", None)  # old checkpoints saved the buffer
    with torch.device("meta"):
        net = family_named(cfg.family).CausalLM(local_config(cfg, split.size) if split is not None else cfg,
                                                reduce=reduce)
    net.load_weights(state, dtype, device)
    _swap_linears(net, dtype, device, batch_invariant, quantization)
    if state:
        logger.warning("unused checkpoint tensors: %s", ", ".join(sorted(state)[:8]))
    logger.info(
        "loaded %s (%s, %s%s) from %s: config %.2fs, weights read %.2fs, placed %.2fs",
        facts.name, dtype, device, f", rank {split.rank} of {split.size}" if split else "", source, config_done - started, read_done - config_done,
        time.perf_counter() - read_done,
    )
    return net, facts
