"""The converted-weights cache (worker/loading/weights_cache.py): a restarted worker
loads the same model from it, and nothing stale or damaged is ever used."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jitney.common.model_files import ModelFiles, load_tokenizer, resolve_model
from jitney.worker.loading import loader
from jitney.worker.loading import weights_cache
from jitney.worker.loading.loader import load_model
from jitney.worker.models.config import ModelConfig, ModelFacts
from jitney.worker.loading.weights_cache import KEEP_ENTRIES, KEEP_META_ENTRIES, META_FILE, WEIGHTS_FILE, WeightsCache, entry_key
from tests.support.tiny_models import make_tiny_llama

CPU = torch.device("cpu")


def _forward(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_a_folder_model_caches_its_facts_and_loads_the_same(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    cache = WeightsCache(tmp_path / "cache")
    fresh, facts = load_model(str(model), torch.float32, CPU, weights_cache=cache)
    (entry,) = [p for p in cache.root.iterdir() if p.is_dir()]
    assert (entry / META_FILE).is_file()
    assert not (entry / WEIGHTS_FILE).exists()   # safetensors folders are read in place
    again, facts_again = load_model(str(model), torch.float32, CPU, max_model_len=64, weights_cache=cache)
    assert facts_again.context_length == min(64, facts.context_length)   # the cap applies after the cache
    assert (facts_again.name, facts_again.vocab_size, facts_again.eos_token_ids) == \
        (facts.name, facts.vocab_size, facts.eos_token_ids)
    for name, tensor in _forward(fresh).items():
        assert torch.equal(tensor, _forward(again)[name]), name


def test_the_default_gguf_model_loads_bit_for_bit_from_the_cache(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path / "cache")
    files = resolve_model(None)
    assert cache.read(files, torch.bfloat16) is None
    fresh, facts = load_model(None, torch.bfloat16, CPU, weights_cache=cache)   # converts, writes
    cached = cache.read(files, torch.bfloat16)
    assert cached is not None and cached.weights is not None and cached.facts == facts
    started = time.perf_counter()
    again, facts_again = load_model(None, torch.bfloat16, CPU, weights_cache=cache)
    print(f"\nload from the cache: {time.perf_counter() - started:.2f} s")
    assert facts_again == facts
    reference = _forward(fresh)
    loaded = _forward(again)
    assert reference.keys() == loaded.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, loaded[name]), name


def test_a_changed_file_or_dtype_misses(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    files = resolve_model(str(model))
    key = entry_key(files, torch.float32)
    assert entry_key(files, torch.bfloat16) != key
    config = model / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert entry_key(files, torch.float32) != key


def test_a_damaged_entry_is_removed_and_the_source_is_loaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    cache = WeightsCache(tmp_path / "cache")
    load_model(str(model), torch.float32, CPU, weights_cache=cache)
    (entry,) = [p for p in cache.root.iterdir() if p.is_dir()]
    (entry / META_FILE).write_text("{not json")
    net, facts = load_model(str(model), torch.float32, CPU, weights_cache=cache)
    assert "unreadable" in caplog.text
    assert facts.vocab_size > 0 and net.config.vocab_size == facts.vocab_size
    assert (entry / META_FILE).is_file() and "{not json" not in (entry / META_FILE).read_text()   # rewritten


def test_a_cache_that_cannot_be_written_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    blocker = tmp_path / "file"
    blocker.write_text("")
    net, _ = load_model(str(model), torch.float32, CPU, weights_cache=WeightsCache(blocker / "cache"))
    assert "could not write the weights cache" in caplog.text
    assert net.config.num_layers > 0


def test_round_trip_and_eviction_keep_the_newest_entries(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path / "cache")
    config = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4)
    facts = ModelFacts("m", 8, 32, (2,))
    state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    written = []
    for i in range(KEEP_ENTRIES + 2):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        (folder / "m.gguf").write_bytes(b"x" * (i + 1))
        files = resolve_model(str(folder / "m.gguf"))
        assert cache.write(files, torch.bfloat16, config, facts, state) is not None
        written.append(files)
        time.sleep(0.01)   # distinct modification times
    got = cache.read(written[-1], torch.bfloat16)
    assert got is not None and got.config == config and got.facts == facts
    assert got.weights is not None
    assert torch.equal(load_file(str(got.weights))["w"], state["w"])
    assert cache.read(written[0], torch.bfloat16) is None   # evicted
    assert len([p for p in cache.root.iterdir() if p.is_dir()]) == KEEP_ENTRIES


def test_config_only_entries_are_evicted_apart_from_converted_ones(tmp_path: Path) -> None:
    # A test run (or a user) that starts many small safetensors models writes an entry for
    # each; they must not push out the GGUF model's converted tensors, which cost seconds.
    cache = WeightsCache(tmp_path / "cache")
    config = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4)
    facts = ModelFacts("m", 8, 32, (2,))
    state = {"w": torch.ones(2, 3, dtype=torch.bfloat16)}

    def model(name: str) -> ModelFiles:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "m.gguf").write_bytes(name.encode())
        return resolve_model(str(folder / "m.gguf"))

    converted = model("converted")
    assert cache.write(converted, torch.bfloat16, config, facts, state) is not None
    small = []
    for i in range(KEEP_META_ENTRIES + 1):
        small.append(model(f"small{i}"))
        assert cache.write(small[-1], torch.bfloat16, config, facts, None) is not None
        stamp = time.time() + i   # distinct modification times, without sleeping
        os.utime(cache.root / entry_key(small[-1], torch.bfloat16), (stamp, stamp))
    kept = cache.read(converted, torch.bfloat16)
    assert kept is not None and kept.weights is not None          # older than them all, still kept
    assert cache.read(small[0], torch.bfloat16) is None           # the oldest config-only one: evicted
    assert cache.read(small[-1], torch.bfloat16) is not None
    assert len([p for p in cache.root.iterdir() if p.is_dir()]) == KEEP_META_ENTRIES + 1


def test_the_conversion_code_is_part_of_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An edit to how the loader converts weights must never read an entry
    # the old code wrote: the key hashes the conversion code's source.
    files = resolve_model(str(make_tiny_llama(tmp_path / "tiny")))
    key = entry_key(files, torch.float32)
    edited = tmp_path / "loader.py"
    edited.write_bytes(Path(loader.__file__).read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(weights_cache, "CODE_FILES", (edited,) + weights_cache.CODE_FILES[1:])
    assert entry_key(files, torch.float32) != key


def test_the_default_tokenizer_loads_the_same_from_its_cache(tmp_path: Path) -> None:
    files = resolve_model(None)
    fresh = load_tokenizer(files, tmp_path)              # converts the GGUF vocabulary, saves it
    (entry,) = tmp_path.glob("tokenizer-*")
    started = time.perf_counter()
    cached = load_tokenizer(files, tmp_path)
    print(f"\ntokenizer from the cache: {time.perf_counter() - started:.2f} s")
    texts = ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café 日本語 🤖",
             "<|im_start|>user\nhi<|im_end|>", "x" * 300]
    for text in texts:
        assert cached.encode(text) == fresh.encode(text), text
        assert cached.decode(cached.encode(text)) == fresh.decode(fresh.encode(text)), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (cached.eos_token_id, len(cached), cached.all_special_ids) == \
        (fresh.eos_token_id, len(fresh), fresh.all_special_ids)
