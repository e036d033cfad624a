"""Tiny random Llama-family models saved as real Hugging Face folders.

Each folder holds config.json, model.safetensors and a small working
byte-level BPE tokenizer with a ChatML template, so the whole server can run
on it. Everything is seeded: the same arguments give the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a jitney is a minibus that picks up passengers anywhere along its route",
    "in-flight batching rebuilds the batch at every generation step",
    "hello world, hello jitney; tokens go in and tokens come out",
] * 20


def make_tokenizer(path: Path, vocab_size: int) -> Any:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    # A small corpus may run out of merges: pad so every model id decodes.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def _save(model: Any, path: Path, vocab_size: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path, vocab_size)
    return path


def make_tiny_llama(
    path: Path,
    *,
    untied: bool = True,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 256,
    rope_parameters: dict[str, Any] | None = None,
    seed: int = 0,
    intermediate_size: int | None = None,
) -> Path:
    """A random fp32 LlamaForCausalLM (GQA) with tokenizer, saved to ``path``
    (``intermediate_size``: default 2 * hidden_size + 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size + 16,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=not untied,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
        # Wider than the default 0.02 so the logits spread out and the
        # comparisons test something.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(config).eval(), path, vocab_size)


def make_tiny_qwen2(path: Path, *, vocab_size: int = 320, seed: int = 0) -> Path:
    """A random fp32 Qwen2ForCausalLM (q/k/v biases, tied head) with tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    # HF initialises biases to zero; random ones make the test see them.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    return _save(model, path, vocab_size)


def _random_qk_norms(model: Any) -> None:
    """Random per-head q/k norm weights (HF makes them ones), so a test sees the norms."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)


def make_tiny_qwen3(path: Path, *, vocab_size: int = 320, seed: int = 0, head_dim: int = 24,
                    attention_bias: bool = False, tied: bool = True, window: int = 0) -> Path:
    """A random fp32 Qwen3ForCausalLM with tokenizer: q/k norms per head (given random
    weights, so the test sees them) and a ``head_dim`` other than hidden / heads. With
    ``window``: ``use_sliding_window``, the second layer windowed (``max_window_layers`` 1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=144, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID, attention_bias=attention_bias, use_sliding_window=bool(window),
        sliding_window=window or None, max_window_layers=1,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    _random_qk_norms(model)
    with torch.no_grad():
        for layer in model.model.layers:
            if attention_bias:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                             layer.self_attn.o_proj):
                    proj.bias.normal_(0, 0.1)
    return _save(model, path, vocab_size)


def make_tiny_phi3(path: Path, *, vocab_size: int = 320, seed: int = 0, longrope: bool = True) -> Path:
    """A random fp32 Phi3ForCausalLM with tokenizer: fused qkv_proj and gate_up_proj in
    its checkpoint; with ``longrope``, LongRoPE factors over an original context of 64
    of 256 positions (random factors, so the test sees them)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    g = torch.Generator().manual_seed(seed + 100)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if longrope:
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
                "long_factor": (1 + 4 * torch.rand(8, generator=g)).tolist()}
    config = Phi3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=144, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0, sliding_window=None,
    )
    torch.manual_seed(seed)
    return _save(Phi3ForCausalLM(config).eval(), path, vocab_size)


def make_tiny_mistral(path: Path, *, vocab_size: int = 320, seed: int = 0, window: int = 7) -> Path:
    """A random fp32 MistralForCausalLM with tokenizer: every layer windowed (``window``
    keys, shorter than the prompts and not a multiple of the block), context 256."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=window,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return _save(MistralForCausalLM(config).eval(), path, vocab_size)


def make_tiny_mixtral(path: Path, *, vocab_size: int = 320, seed: int = 0, window: int | None = None) -> Path:
    """A random fp32 MixtralForCausalLM with tokenizer: 2 of 6 experts per token; with
    ``window``, every layer windowed (as transformers' Mixtral applies ``sliding_window``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, sliding_window=window, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return _save(MixtralForCausalLM(config).eval(), path, vocab_size)


def make_tiny_qwen3_moe(path: Path, *, vocab_size: int = 320, seed: int = 0, mlp_only_layers: tuple[int, ...] = (1,),
                        norm_topk_prob: bool = False) -> Path:
    """A random fp32 Qwen3MoeForCausalLM with tokenizer: 3 layers, by default the middle one a
    dense MLP (``mlp_only_layers``), 3 of 8 experts per token, by default without renormalising."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=80, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(mlp_only_layers), max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID, use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    _random_qk_norms(model)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "weight") and gate.weight.dim() == 2 and gate.weight.shape[0] == 8:
                gate.weight.normal_(0, 0.5)   # HF initialises the router to zeros: every expert ties
    return _save(model, path, vocab_size)


def make_tiny_gemma(path: Path, *, version: int = 3, vocab_size: int = 320, seed: int = 0, window: int = 6,
                    layer_types: tuple[str, ...] | None = None, query_pre_attn_scalar: int = 24) -> Path:
    """A random fp32 Gemma2ForCausalLM or Gemma3ForCausalLM (text) with tokenizer: by default 4 layers,
    sliding (a ``window`` shorter than the prompts, not a multiple of the block) and global
    interleaved (``layer_types``), the norms' weights random (their 1 + w shows); Gemma 2 soft-caps the scores
    and the logits, Gemma 3 has q/k norms and its own rotary base for the sliding layers."""
    types = list(layer_types or ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=window,
        layer_types=types, query_pre_attn_scalar=query_pre_attn_scalar, initializer_range=0.1, bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID, pad_token_id=0)
    if version == 2:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config: Any = Gemma2Config(**common, attn_logit_softcapping=8.0, final_logit_softcapping=5.0)
        cls: Any = Gemma2ForCausalLM
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(**common, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        cls = Gemma3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    return _save(model, path, vocab_size)


def make_tiny_gpt_oss(path: Path, *, vocab_size: int = 320, seed: int = 0, window: int = 6,
                      mxfp4_round_trip: bool = False) -> Path:
    """A random fp32 GptOssForCausalLM with tokenizer: 3 layers, sliding (a ``window``
    shorter than the prompts) and full interleaved, 3 of 8 experts per token, YaRN rotary
    (factor 4 over an original 64 positions); sinks, router, attention and expert biases
    random (transformers initialises most to zeros), a SwiGLU limit of 1.5 that the
    experts' gates and ups cross. ``mxfp4_round_trip``: the experts' weights replaced by
    their MXFP4 round trip (``mxfp4_pack`` then de-quantised), so an MXFP4 checkpoint of
    them holds exactly these values."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        rms_norm_eps=1e-6, swiglu_limit=1.5, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.normal_(0, 0.5)
            elif "experts" in name:
                param.normal_(0, 0.3)
            elif "norm" in name:
                param.normal_(1, 0.2)
        if mxfp4_round_trip:
            from jitney.worker.layers.mxfp4 import dequantize_mxfp4

            for layer in model.model.layers:
                experts = layer.mlp.experts
                for leaf in ("gate_up_proj", "down_proj"):
                    weight = getattr(experts, leaf)
                    blocks, scales = mxfp4_pack(weight.transpose(1, 2))
                    weight.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    return _save(model, path, vocab_size)


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (..., K)`` float -> MXFP4 ``blocks (..., K / 32, 16)`` and ``scales
    (..., K / 32)`` uint8: per 32 values the power of two that puts their largest
    magnitude in [4, 8) (6 is FP4's largest value; above it rounds down to 6), each value
    rounded to the nearest FP4 E2M1 value (ties to the lower code)."""
    from jitney.worker.layers.mxfp4 import E2M1_VALUES

    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1).clamp_min(2.0 ** -120)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    code = code + 8 * (scaled < 0).long()
    nibbles = code.to(torch.uint8).reshape(*code.shape[:-1], 16, 2)
    blocks = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return blocks, scales


def write_mxfp4_gpt_oss(source: Path, path: Path) -> Path:
    """A copy of tiny gpt-oss folder ``source`` as the released checkpoints are: its
    experts' weights as MXFP4 ``_blocks`` and ``_scales`` and ``quantization_config``
    quant_method "mxfp4" (exact only for weights ``mxfp4_round_trip`` made)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    state = load_file(str(source / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_pack(state.pop(name).transpose(1, 2))   # (E, out, in): rows of `in` values
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
