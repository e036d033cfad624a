"""Jitney's model over the paged cache vs transformers' own forward.

Tolerances: on the tiny fp32 models, every logit within atol 1e-4 of
transformers' eager forward of the full sequence (observed: ~3e-6). On the
default SmolLM2 GGUF in fp32, within atol 1e-3 of transformers' GGUF model
(logits up to ~40; observed: 0). In bfloat16 the last-position argmax matches
the fp32 reference and logits stay within atol 2.0 (observed: ~1.2).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.support.reference_model import default_model_reference
from tests.support.tiny_models import make_tiny_llama, make_tiny_qwen2
from jitney.worker.kernels.cpu.packed import PackedLinear, pack_linears, packing_supported
from jitney.worker.attention.backend import AttentionMetadata
from jitney.worker.attention.kv_cache import CacheGeometry, PagedKVCache
from jitney.common.model_files import resolve_model
from jitney.worker.loading.loader import (UnsupportedModelError, load_hf_config, load_model, model_config_from_hf,
                                          source_facts)
from jitney.worker.models.llama import CausalLM

CPU = torch.device("cpu")
TINY_ATOL = 1e-4


def reference(path: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kwargs).eval()


def new_cache(net: CausalLM, block_size: int, num_blocks: int = 64, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    cfg = net.config
    geometry = CacheGeometry(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    return PagedKVCache(geometry, num_blocks, CPU)


@torch.inference_mode()
def step(
    net: CausalLM,
    cache: PagedKVCache,
    batch: list[tuple[list[int], int, list[int]]],
) -> list[torch.Tensor]:
    """One fused step. Each entry: (new token ids, start position, block table).

    Returns each entry's logits (n_new, vocab). Entries with one token must
    come first (the decodes).
    """
    bs = cache.geometry.block_size
    meta = AttentionMetadata.build(
        query_lens=[len(t) for t, _, _ in batch],
        seq_lens=[start + len(t) for t, start, _ in batch],
        block_tables=[table for _, _, table in batch],
        block_size=bs,
        device=CPU,
    )
    ids = torch.tensor([tok for t, _, _ in batch for tok in t])
    positions = torch.tensor([p for t, start, _ in batch for p in range(start, start + len(t))])
    logits = net.compute_logits(net(ids, positions, meta, cache), torch.arange(len(ids)))
    return list(logits.split([len(t) for t, _, _ in batch]))


def run_chunks(net: CausalLM, cache: PagedKVCache, ids: list[int], sizes: list[int], table: list[int]) -> torch.Tensor:
    out, start = [], 0
    for size in sizes:
        out += step(net, cache, [(ids[start : start + size], start, table)])
        start += size
    return torch.cat(out)


@torch.inference_mode()
def hf_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, torch.nn.Module]:
    path = make_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny")
    net, _ = load_model(str(path), torch.float32, CPU)
    return net, reference(path)


def prompt(n: int, seed: int = 0, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_one_shot_prefill_matches_transformers(tiny_llama: tuple[CausalLM, torch.nn.Module]) -> None:
    net, ref = tiny_llama
    ids = prompt(29)
    got = run_chunks(net, new_cache(net, 4), ids, [29], [3, 0, 9, 5, 1, 2, 8, 4])
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=TINY_ATOL, rtol=0)


def test_three_uneven_chunks_match_full_prefill(tiny_llama: tuple[CausalLM, torch.nn.Module]) -> None:
    net, ref = tiny_llama
    ids = prompt(31, seed=1)
    # Chunk edges fall inside blocks; the block ids are scattered.
    got = run_chunks(net, new_cache(net, 4), ids, [7, 13, 11], [12, 3, 40, 7, 8, 21, 0, 33])
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=TINY_ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_a_prefill_chunk(tiny_llama: tuple[CausalLM, torch.nn.Module]) -> None:
    net, ref = tiny_llama
    cache = new_cache(net, 4)
    seqs = {i: prompt(n, seed=10 + i) for i, n in enumerate([8, 11, 5, 17])}
    tables = {0: [9, 2, 30], 1: [1, 14, 6, 20], 2: [3, 25], 3: [40, 41, 4, 5, 13]}
    # Warm up seqs 0-2 to one token short of their prompt; seq 3 gets half.
    for i in range(3):
        run_chunks(net, cache, seqs[i][:-1], [len(seqs[i]) - 1], tables[i])
    run_chunks(net, cache, seqs[3][:9], [9], tables[3])
    # One fused step: three decodes (seq 0 crosses into its 3rd block at
    # position 8) plus the rest of seq 3's prompt.
    batch = [([seqs[i][-1]], len(seqs[i]) - 1, tables[i]) for i in range(3)]
    batch.append((seqs[3][9:], 9, tables[3]))
    out = step(net, cache, batch)
    for i in range(3):
        torch.testing.assert_close(out[i][-1], hf_logits(ref, seqs[i])[-1], atol=TINY_ATOL, rtol=0)
    torch.testing.assert_close(out[3], hf_logits(ref, seqs[3])[9:], atol=TINY_ATOL, rtol=0)


def test_decode_many_steps_across_blocks(tiny_llama: tuple[CausalLM, torch.nn.Module]) -> None:
    net, ref = tiny_llama
    ids = prompt(21, seed=3)
    got = run_chunks(net, new_cache(net, 4), ids, [6] + [1] * 15, [7, 1, 60, 2, 33, 4])
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=TINY_ATOL, rtol=0)


def test_tied_llama3_rope_model(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    }
    path = make_tiny_llama(tmp_path / "l3", untied=False, rope_parameters=rope, seed=5)
    net, _ = load_model(str(path), torch.float32, CPU)
    assert net.config.rope_scaling is not None and net.lm_head is None
    ids = prompt(40, seed=4)
    got = run_chunks(net, new_cache(net, 8), ids, [16, 24], [4, 1, 3, 0, 2])
    torch.testing.assert_close(got, hf_logits(reference(path), ids), atol=TINY_ATOL, rtol=0)


def test_qwen2_with_qkv_bias(tmp_path: Path) -> None:
    path = make_tiny_qwen2(tmp_path / "qwen")
    net, _ = load_model(str(path), torch.float32, CPU)
    assert net.config.qkv_bias and not net.config.o_bias
    ids = prompt(26, seed=6)
    got = run_chunks(net, new_cache(net, 4), ids, [10, 1, 15], [5, 6, 1, 9, 3, 2, 8])
    torch.testing.assert_close(got, hf_logits(reference(path), ids), atol=TINY_ATOL, rtol=0)


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(str(tmp_path))
    from jitney.common.model_files import resolve_model

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        model_config_from_hf(load_hf_config(resolve_model(tmp_path)))


def test_model_facts_and_length_cap(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path / "m", max_position_embeddings=128)
    _, facts = load_model(str(path), torch.float32, CPU, max_model_len=100)
    assert (facts.name, facts.vocab_size, facts.context_length, facts.eos_token_ids) == ("m", 320, 100, (2,))


def test_eos_ids_are_the_configs_the_generation_configs_and_the_tokenizers(tmp_path: Path) -> None:
    """A chat model's generation_config.json lists its end-of-turn token next to
    the base EOS (Gemma 3: [1, 106]); every one of them, and the tokenizer's
    eos_token, ends a sequence."""
    path = make_tiny_llama(tmp_path / "m")                    # config.json: eos 2
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7, 2, 11]}))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok, "eos_token": "<|endoftext|>"}))  # id 0
    assert source_facts(resolve_model(path), load_hf_config(resolve_model(path))).eos_token_ids == (2, 7, 11, 0)
    (path / "generation_config.json").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({**tok, "eos_token": "not-a-token"}))
    assert source_facts(resolve_model(path), load_hf_config(resolve_model(path))).eos_token_ids == (2,)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, torch.nn.Module, list[int]]:
    from jitney.common.model_files import cache_root, load_tokenizer, resolve_model

    files = resolve_model(None)
    net, facts = load_model(None, torch.float32, CPU)
    assert facts.eos_token_ids == (2,) and facts.vocab_size == 49152
    ref = default_model_reference(tmp_path_factory)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = load_tokenizer(files, cache_root()).apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return net, ref, list(ids)


@pytest.mark.slow
def test_default_gguf_model_matches_transformers(smollm2: tuple[CausalLM, torch.nn.Module, list[int]]) -> None:
    net, ref, ids = smollm2
    got = run_chunks(net, new_cache(net, 16), ids, [len(ids) - 10, 10], [5, 2, 7, 0])
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_default_gguf_model_in_bfloat16(smollm2: tuple[CausalLM, torch.nn.Module, list[int]]) -> None:
    net, ref, ids = smollm2
    # A cast copy instead of a second slow GGUF load (rope's inv_freq is a
    # plain float32 tensor, not a module buffer: the cast leaves it).
    net16 = copy.deepcopy(net).to(torch.bfloat16)
    got = run_chunks(net16, new_cache(net16, 16, dtype=torch.bfloat16), ids, [len(ids)], [1, 2, 3])
    want = hf_logits(ref, ids)
    assert got[-1].argmax() == want[-1].argmax()
    torch.testing.assert_close(got, want, atol=2.0, rtol=0)
    if packing_supported(torch.bfloat16, torch.device("cpu")):
        # As load_model serves it on this CPU: oneDNN-packed linears, tied head packed too.
        net16.lm_head = PackedLinear(net16.model.embed_tokens.weight, None)
        assert pack_linears(net16) == 4 * len(net16.model.layers)
        packed = run_chunks(net16, new_cache(net16, 16, dtype=torch.bfloat16), ids, [len(ids)], [1, 2, 3])
        assert packed[-1].argmax() == want[-1].argmax()
        torch.testing.assert_close(packed, got, atol=0.5, rtol=0)
