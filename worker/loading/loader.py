"""Load a Llama-family model's config and weights through transformers.

Two sources: a Hugging Face folder (``config.json`` + ``*.safetensors``) or a
GGUF file (de-quantised by transformers' GGUF reader). Never pickle: ``.bin``
checkpoints are refused. The tokenizer is not loaded here unless neither the
configs nor the tokenizer's files name an end-of-sequence token.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from jitney.common.model_files import ModelFiles, gguf_metadata, load_tokenizer, resolve_model
from jitney.worker.layers.linear import NO_SHARD, Loaded
from jitney.worker.layers.linear_kernel import choose_linear_kernel
from jitney.worker.layers.reduce import Reduce, no_reduce
from jitney.worker.models.config import ModelConfig, ModelFacts, UnsupportedModelError
from jitney.worker.models.registry import ServedModel, family_for, family_named
from jitney.worker.distributed.sharding import Shard, check_shardable, local_config
from jitney.worker.loading.checkpoint import drained, safetensors_tensors
from jitney.worker.loading.weights_cache import WeightsCache

logger = logging.getLogger("jitney.worker")

def load_hf_config(files: ModelFiles) -> Any:
    """The transformers config of the model, read offline (a GGUF file's completed by
    ``gguf_config_fixes``)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(files.directory), local_files_only=True, **files.pretrained_kwargs())
    if files.gguf_file is not None:
        gguf_config_fixes(files.directory / files.gguf_file, hf)
    return hf


# GGUF metadata transformers' reader (integrations/ggml.py) leaves out of these configs,
# where its class default differs from real checkpoints: {model_type: {gguf key tail: config attribute}}.
# Qwen3's head_dim is 128 (Qwen3-0.6B: 1024 wide, 16 heads) whatever hidden / heads says; the
# experts' width and Gemma 2's caps have defaults of one size of model only.
_GGUF_KEYS = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen3_moe": {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
                  "expert_weights_norm": "norm_topk_prob"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3_text": {"rope.freq_base_swa": "sliding_attention"},
}


def gguf_config_fixes(path: Path, hf: Any) -> None:
    """Set on ``hf`` (read from the GGUF file ``path``) what ``_GGUF_KEYS`` maps that
    the file states; Gemma 3's sliding layers' rotary base goes into its rope_parameters."""
    if getattr(hf, "model_type", "") == "phi3":
        _refuse_gguf_longrope(path)
    wanted = _GGUF_KEYS.get(getattr(hf, "model_type", ""), {})
    if not wanted:
        return
    meta = gguf_metadata(path, lambda key: key.split(".", 1)[-1] in wanted)
    for key, value in meta.items():
        attribute = wanted[key.split(".", 1)[-1]]
        if attribute == "sliding_attention":
            hf.rope_parameters[attribute]["rope_theta"] = float(value)
        else:
            setattr(hf, attribute, value)


def model_config_from_hf(hf: Any) -> ModelConfig:
    """The config of the family that runs ``hf`` (``models/registry.py``), refusing what none can run."""
    return family_for(hf).config_from_hf(hf)


def model_facts(files: ModelFiles, hf: Any, max_model_len: int | None) -> ModelFacts:
    """Name, vocabulary size, context length and EOS ids of the model."""
    return cap_context(source_facts(files, hf), max_model_len)


def source_facts(files: ModelFiles, hf: Any) -> ModelFacts:
    """The model's facts as its files state them (no ``--max-model-len`` cap)."""
    return ModelFacts(
        name=files.name,
        vocab_size=int(hf.vocab_size),
        context_length=int(hf.max_position_embeddings),
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
    """Every id that ends a sequence: config.json's, generation_config.json's
    (a list where chat models end turns with another token than the base
    model's EOS: Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``) and the
    tokenizer's ``eos_token``, in that order, each once."""
    ids: list[int] = []
    for value in (getattr(hf, "eos_token_id", None), getattr(_generation_config(files), "eos_token_id", None),
                  _tokenizer_eos_id(files)):
        for token in [value] if isinstance(value, int) else (value or []):
            if int(token) not in ids:
                ids.append(int(token))
    if not ids:
        # Slow path (a GGUF tokenizer conversion takes seconds): only when
        # neither config nor the tokenizer's files name an EOS token.
        eos = load_tokenizer(files).eos_token_id
        ids = [int(eos)] if eos is not None else []
    return tuple(ids)


def _tokenizer_eos_id(files: ModelFiles) -> int | None:
    """The id of a Hugging Face folder's tokenizer ``eos_token``, read from its
    files (tokenizer_config.json names it; tokenizer.json's added tokens give
    its id) without building the tokenizer; None where they do not say."""
    config, vocab = files.directory / "tokenizer_config.json", files.directory / "tokenizer.json"
    if files.gguf_file is not None or not (config.is_file() and vocab.is_file()):
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    content = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(content, str):
        return None
    added = json.loads(vocab.read_text()).get("added_tokens") or []
    return next((int(t["id"]) for t in added if t.get("content") == content), None)


def _generation_config(files: ModelFiles) -> Any:
    if files.gguf_file is not None or not (files.directory / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(files.directory), local_files_only=True)


def source_paths(files: ModelFiles) -> list[Path]:
    """The safetensors files of a Hugging Face folder (pickled ``.bin`` files are refused)."""
    paths = sorted(files.directory.glob("*.safetensors"))
    if not paths:
        raise UnsupportedModelError(f"{files.directory} has no *.safetensors (pickled .bin files are refused)")
    return paths


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


def _refuse_gguf_longrope(path: Path) -> None:
    """Refuse a Phi-3 GGUF with LongRoPE factors (``rope_factors_long/short``): transformers'
    reader drops them and its config says plain rotary, which would serve wrong tokens at
    every position (the short factors apply within the original context too)."""
    from gguf import GGUFReader

    names = {t.name for t in GGUFReader(str(path)).tensors}
    if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise UnsupportedModelError(f"{path}: a Phi-3 GGUF with LongRoPE factors (rope_factors_long/short) is not "
                                    "supported: transformers' GGUF reader drops them; serve the Hugging Face folder")


def _load_gguf_tensors(path: Path, hf: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names = _ParameterNames(AutoModelForCausalLM.from_config(hf))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names, torch_dtype=dtype)
    return _per_expert(parsed["tensors"])


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with stacked experts (transformers' ``mlp.experts.gate_up_proj``
    [experts, 2 * inter, hidden], gate rows first, and ``.down_proj`` [experts, hidden,
    inter], what its reader makes of ``ffn_*_exps``) as the per-expert checkpoint names
    the families read (``mlp.experts.{e}.gate_proj.weight``; views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        block, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{block}.experts.{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{block}.experts.{e}.up_proj.weight"] = tensor[e, half:]
        elif kind == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{block}.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def load_model(
    model: str | None, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
    *, batch_invariant: bool = False, quantization: str = "none", weights_cache: WeightsCache | None = None,
    shard: Shard | None = None, reduce: Reduce = no_reduce,
) -> tuple[ServedModel, ModelFacts]:
    """Load ``model`` (path or ``None`` = bundled default) ready to run.

    ``batch_invariant`` and ``quantization`` choose the linears' kernel
    (``layers/linear_kernel.py``). With a ``weights_cache``, the config, the facts and
    (for GGUF) the converted tensors come from its entry for these files and
    this dtype, and a miss writes the entry (``weights_cache.py``).
    ``shard``: a tensor-parallel rank's model (its local config and weights,
    ``sharding.py``: each linear loads its own part), whose row-parallel layers sum over
    the group with ``reduce``; a model whose heads or MLP do not split ``shard.size``
    ways raises ``ValueError``.
    """
    started = time.perf_counter()
    kernel = choose_linear_kernel(dtype, device, batch_invariant, quantization)
    files = resolve_model(model)
    split = shard if shard is not None and shard.size > 1 else None
    cached = weights_cache.read(files, dtype) if weights_cache is not None else None
    tensors: Iterator[tuple[str, Loaded]]
    if cached is not None:
        cfg, facts = cached.config, cached.facts
        if split is not None:
            check_shardable(cfg, split.size)
        config_done = time.perf_counter()
        tensors = safetensors_tensors([cached.weights] if cached.weights is not None else source_paths(files))
        source = f"weights cache {weights_cache.root if weights_cache else ''}"
    else:
        hf = load_hf_config(files)
        cfg = model_config_from_hf(hf)
        if files.gguf_file is not None and not getattr(family_named(cfg.family), "READS_GGUF", True):
            raise UnsupportedModelError(f"{cfg.family} from a GGUF file is not supported "
                                        "(load its Hugging Face safetensors folder)")
        facts = source_facts(files, hf)
        if split is not None:
            check_shardable(cfg, split.size)
        config_done = time.perf_counter()
        source = "source files"
        if files.gguf_file is not None:
            # The cache keeps whole tensors: a GGUF rank converts all of it; its linears take their parts.
            state = _load_gguf_tensors(files.directory / files.gguf_file, hf, dtype)
            tensors = drained(state)
        else:
            state, tensors = None, safetensors_tensors(source_paths(files))
        if weights_cache is not None:
            written = weights_cache.write(files, dtype, cfg, facts, state)
            if written is not None:
                logger.info("wrote the converted model to the weights cache (%s)", written)
    facts = cap_context(facts, max_model_len)
    read_done = time.perf_counter()
    skip = {"model.rotary_emb.inv_freq"} | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    with torch.device("meta"):
        net = family_named(cfg.family).CausalLM(local_config(cfg, split.size) if split is not None else cfg,
                                                reduce=reduce, shard=split or NO_SHARD, kernel=kernel)
    # (old checkpoints saved the rotary buffer; some store the tied head's copy)
    unused = net.load_weights(((n, t) for n, t in tensors if n not in skip), dtype, device)
    if unused:
        logger.warning("unused checkpoint tensors: %s", ", ".join(sorted(unused)[:8]))
    logger.info(
        "loaded %s (%s, %s%s) from %s: config %.2fs, GGUF conversion %.2fs, weights read and placed %.2fs",
        facts.name, dtype, device, f", rank {split.rank} of {split.size}" if split else "", source, config_done - started, read_done - config_done,
        time.perf_counter() - read_done,
    )
    return net, facts
