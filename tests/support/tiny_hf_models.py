"""Tiny random checkpoints of architectures Jitney has no native family for:
the ones the transformers fallback serves (Starcoder2, GLM, Phi, Granite, a
windowed Starcoder2, VaultGemma) and ones no path can serve (T5, Mamba,
StableLm), saved as real
Hugging Face folders with ``tiny_models``' tokenizer. Seeded: the same
arguments give the same files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.tiny_models import EOS_TOKEN_ID, make_tokenizer

VOCAB = 320
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
    # Wider than the default 0.02 so the logits spread out and the comparisons test something.
    initializer_range=0.1,
)


def _configs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """kind -> (config class, model class, arguments beyond ``_COMMON``)."""
    import transformers as t

    return {
        # LayerNorm with biases, GELU MLP, biased projections, GQA
        "starcoder2": (t.Starcoder2Config, t.Starcoder2ForCausalLM, dict(num_key_value_heads=2, sliding_window=None)),
        # partial rotary (half of each head), interleaved rotary pairs, fused gate_up
        "glm": (t.GlmConfig, t.GlmForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
        # parallel attention and MLP, partial rotary, a biased head
        "phi": (t.PhiConfig, t.PhiForCausalLM, dict(num_key_value_heads=4)),
        # logits divided by logits_scaling after the head
        "granite": (t.GraniteConfig, t.GraniteForCausalLM, dict(num_key_value_heads=2, logits_scaling=2.0)),
        # every layer windowed, 6 keys: shorter than most prompts of the fallback's tests
        "starcoder2-window": (t.Starcoder2Config, t.Starcoder2ForCausalLM, dict(num_key_value_heads=2,
                                                                                sliding_window=6)),
        # Gemma-like with no native family: windows of 5 on alternate layers, attention logits
        # soft-capped at 3 (low enough that the cap changes them), final logits at 10
        "vaultgemma": (t.VaultGemmaConfig, t.VaultGemmaForCausalLM, dict(
            num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=3.0,
            final_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"])),
        # served natively (models/gemma.py), not by the fallback
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
        # no path: its layers do not pass keyword arguments down to attention
        "stablelm": (t.StableLmConfig, t.StableLmForCausalLM, dict(num_key_value_heads=2)),
    }


FALLBACK_KINDS = ("starcoder2", "glm", "phi", "granite")


def make_tiny_hf(path: Path, kind: str, *, seed: int = 0, tokenizer: bool = True) -> Path:
    """A random fp32 decoder of ``kind`` (a key of ``_configs``) saved to ``path``."""
    config_class, model_class, extra = _configs()[kind]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**_COMMON, **extra})).eval()
    with torch.no_grad():   # HF zeroes biases; random ones make the tests see them
        for name, param in model.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                param.normal_(0, 0.1)
    return _save(model, path, tokenizer)


def make_tiny_t5(path: Path) -> Path:
    """A random T5 (an encoder-decoder: no path runs it)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                      decoder_start_token_id=0, eos_token_id=EOS_TOKEN_ID, pad_token_id=0)
    torch.manual_seed(0)
    return _save(T5ForConditionalGeneration(config).eval(), path, True)


def make_tiny_mamba(path: Path) -> Path:
    """A random Mamba (state-space layers: no path runs it)."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2,
                         eos_token_id=EOS_TOKEN_ID, pad_token_id=0)
    torch.manual_seed(0)
    return _save(MambaForCausalLM(config).eval(), path, True)


def _save(model: Any, path: Path, tokenizer: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        make_tokenizer(path, VOCAB)
    return path


@torch.inference_mode()
def generate_reference(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` of each prompt alone, fp32, no EOS stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # (Jitney's drivers stop at max_tokens only)
    outs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs
