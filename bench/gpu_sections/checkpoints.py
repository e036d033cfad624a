"""The model shapes, the tokenizer and the random-weight checkpoints bench/gpu.py measures."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from bench.gpu_sections.plumbing import dtype_name, free_device_memory, log

_LLAMA_COMMON: dict[str, Any] = {"vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                                 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SHAPES: dict[str, dict[str, Any]] = {
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, "tie_word_embeddings": True, "rope_theta": 100000.0},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "tie_word_embeddings": False, "rope_theta": 500000.0},
    # vocab 49152 like the others, so the workloads' token ids fit.
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "tie_word_embeddings": True, "rope_theta": 10000.0,
             "max_position_embeddings": 1024},
}


def make_fast_tokenizer(path: Path, vocab_size: int) -> Path:
    """A byte-level BPE of exactly ``vocab_size`` tokens, saved to ``path`` in well under a second.

    Like tests/support/tiny_models.py's (its special tokens, EOS and chat template),
    but the ids past the byte alphabet are plain vocabulary entries, not
    added tokens: tiny_models' 49k added tokens take ~3 s to make and ~3 s
    for every server's scheduler to load, too slow for ``make test``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.support.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    vocab.update({f"<|extra_{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


def tokenizer_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """``--tokenizer``, or a local byte-level BPE of the model vocabulary (``make_fast_tokenizer``)."""
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    log(f"making a byte-level BPE tokenizer of {_LLAMA_COMMON['vocab_size']} tokens")
    return make_fast_tokenizer(scratch / "tokenizer", _LLAMA_COMMON["vocab_size"])


def llama_config(shape: str) -> Any:
    from transformers import LlamaConfig

    spec = {**_LLAMA_COMMON, **SHAPES[shape]}
    theta = spec.pop("rope_theta")
    return LlamaConfig(**spec, rope_parameters={"rope_type": "default", "rope_theta": theta})


def make_checkpoint(shape: str, path: Path, tokenizer: Path, args: argparse.Namespace) -> Path:
    """A random-weight LlamaForCausalLM of ``shape``, built on the device, saved with the tokenizer files."""
    import torch
    from transformers import LlamaForCausalLM

    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(llama_config(shape)).to(getattr(torch, dtype_name(args))).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    free_device_memory(args)
    for item in tokenizer.iterdir():
        if item.is_file():
            shutil.copy2(item, path / item.name)
    log(f"== {shape}: checkpoint made in {time.perf_counter() - started:.1f} s")
    return path
