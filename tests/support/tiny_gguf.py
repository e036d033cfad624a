"""Write a tiny Hugging Face model folder (``tiny_models.py``) as one GGUF file, the
way llama.cpp lays one out, so the GGUF path of each family is tested on files of
known content.

Written with gguf's ``GGUFWriter``: the architecture's hyper-parameters under
``{arch}.*``, tensors under gguf's names (``get_tensor_name_map``), F32 unless
``dtype`` says F16 or Q8_0 (norms, routers and 1-D tensors stay F32, as
llama.cpp's converter keeps them). What transformers' GGUF reader undoes is done
here: Gemma's norms are stored as 1 + w, and the experts' stacked gate/up split into
``ffn_gate_exps`` and ``ffn_up_exps``. No tokenizer vocabulary: the reader only
needs the BOS/EOS ids for a config, and the runner takes token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# transformers' model_type -> gguf's architecture
ARCHITECTURES = {"qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3",
                 "phi3": "PHI3"}


def _hf_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors, stacked experts split into per-kind stacks
    (gguf names ``mlp.experts.gate_proj`` / ``up_proj`` / ``down_proj``: [experts, out, in])."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            half = tensor.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = tensor[:, :half]
            out[name.replace("gate_up_proj", "up_proj")] = tensor[:, half:]
        else:
            out[name] = tensor
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _metadata(writer: Any, hf: Any, model_type: str) -> None:
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_vocab_size(hf.vocab_size)
    rope = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in rope:      # Gemma 3: a base for the global layers, another for the sliding ones
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    else:
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(head_dim)
    if model_type == "qwen3_moe":
        writer.add_expert_count(hf.num_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
    if model_type.startswith("gemma"):
        writer.add_sliding_window(hf.sliding_window)
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(hf.attn_logit_softcapping)
        writer.add_final_logit_softcapping(hf.final_logit_softcapping)
    writer.add_bos_token_id(hf.bos_token_id)
    writer.add_eos_token_id(hf.eos_token_id)
    writer.add_pad_token_id(hf.pad_token_id if hf.pad_token_id is not None else 0)


def quantised(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``write_gguf`` stores HF tensor ``name`` in its ``dtype`` (else F32)."""
    return tensor.dim() >= 2 and "norm" not in name and not name.endswith("mlp.gate.weight")


def write_gguf(folder: Path, path: Path, *, dtype: str = "F32") -> Path:
    """The tiny model in ``folder`` as the GGUF file ``path``; ``dtype``: F32, F16 or Q8_0
    for the 2-D (and stacked expert) weights the converter would quantise."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf = model.config
    model_type = hf.model_type
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    names = gguf.get_tensor_name_map(arch, hf.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(folder.name)
    _metadata(writer, hf, model_type)
    rope = getattr(hf, "rope_parameters", None) or {}
    for name, tensor in _hf_tensors(model).items():
        stem = name.removesuffix(".weight").removesuffix(".bias")
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ValueError(f"{model_type}: gguf has no name for {name}")
        gguf_name += name[len(stem):] or ".weight"    # HF's stacked experts are bare parameters
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1    # llama.cpp stores Gemma's norm as its scale 1 + w
        data = tensor.numpy().astype(np.float32)
        quantise = quantised(name, tensor)
        if quantise and dtype == "F16":
            writer.add_tensor(gguf_name, data.astype(np.float16))
        elif quantise and dtype == "Q8_0":
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, data)
    if rope.get("rope_type") == "longrope":     # llama.cpp keeps Phi-3's factors as two tensors
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
