"""jitney/common/lora_adapter.py: a PEFT folder read and checked without torch;
every refusal names the problem. Folders are written by
tests/support/lora_folders.py (PEFT's names and layout), one by PEFT itself."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from jitney.common.lora_adapter import AdapterError, ModuleShape, check_adapter, read_adapter
from tests.support.lora_folders import HIDDEN, LAYERS, MODULES, write_adapter

SHAPES = [ModuleShape(n, i, o, LAYERS) for n, (i, o) in MODULES.items()]


def _edit_config(path: Path, **changes: object) -> Path:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _drop_tensor(path: Path, half: str) -> Path:
    from safetensors.numpy import load_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    del tensors[f"base_model.model.model.layers.1.self_attn.v_proj.lora_{half}.weight"]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _bin_only(path: Path) -> Path:
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    return path


READ_REFUSALS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("not a folder", lambda d: d / "nothing", "not a folder"),
    ("no config", lambda d: _unlink(write_adapter(d), "adapter_config.json"), "no adapter_config.json"),
    ("bad JSON", lambda d: _write(write_adapter(d), "adapter_config.json", "{r: 4"), "not readable JSON"),
    ("not LORA", lambda d: _edit_config(write_adapter(d), peft_type="IA3"), "only LORA adapters"),
    ("DoRA", lambda d: _edit_config(write_adapter(d), use_dora=True), "DoRA is not supported"),
    ("modules_to_save", lambda d: _edit_config(write_adapter(d), modules_to_save=["lm_head"]),
     "modules_to_save"),
    ("missing A", lambda d: _drop_tensor(write_adapter(d), "A"), "layer 1 v_proj has no lora_A tensor"),
    ("missing B", lambda d: _drop_tensor(write_adapter(d), "B"), "layer 1 v_proj has no lora_B tensor"),
    ("rank mismatch", lambda d: _edit_config(write_adapter(d, rank=4), r=8), "has rank 4, its config says 8"),
    (".bin only", lambda d: _bin_only(write_adapter(d)), "adapter_model.bin, a pickle, is not loaded"),
    ("no weights", lambda d: _unlink(write_adapter(d), "adapter_model.safetensors"), "no adapter_model.safetensors"),
    ("bias", lambda d: _edit_config(write_adapter(d), bias="all"), "only bias \"none\""),
]


def _unlink(path: Path, name: str) -> Path:
    (path / name).unlink()
    return path


def _write(path: Path, name: str, text: str) -> Path:
    (path / name).write_text(text)
    return path


@pytest.mark.parametrize("case", READ_REFUSALS, ids=[c[0] for c in READ_REFUSALS])
def test_read_refusals(tmp_path: Path, case: tuple[str, Callable[[Path], Path], str]) -> None:
    _, make, words = case
    with pytest.raises(AdapterError) as refused:
        read_adapter(make(tmp_path / "adapter"))
    assert words in str(refused.value)


CHECK_REFUSALS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("rank above the max", lambda d: write_adapter(d, rank=16), "rank 16 is above --max-lora-rank 8"),
    ("unknown module", lambda d: write_adapter(d, modules=("q_proj", "gate_proj")),
     "targets 'gate_proj', which this model does not offer (it offers q_proj, v_proj)"),
    ("wrong shapes", lambda d: write_adapter(d, shapes={"v_proj": (HIDDEN, 48)}),
     "maps 64 -> 48 features, the model's 64 -> 32"),
    ("layer out of range", lambda d: write_adapter(d, layers=(0, 2)), "layer 2 q_proj: the model has 2 layers"),
]


@pytest.mark.parametrize("case", CHECK_REFUSALS, ids=[c[0] for c in CHECK_REFUSALS])
def test_check_refusals(tmp_path: Path, case: tuple[str, Callable[[Path], Path], str]) -> None:
    _, make, words = case
    spec = read_adapter(make(tmp_path / "adapter"))
    with pytest.raises(AdapterError) as refused:
        check_adapter(spec, SHAPES, max_rank=8)
    assert words in str(refused.value)


def test_a_good_adapter_and_its_scalings(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "good", rank=4, lora_alpha=8, use_rslora=False)
    spec = read_adapter(path)
    check_adapter(spec, SHAPES, max_rank=4)
    assert (spec.rank, spec.targets, len(spec.tensors)) == (4, ("q_proj", "v_proj"), 2 * LAYERS)
    assert {t.scaling for t in spec.tensors} == {2.0}
    rs = read_adapter(_edit_config(write_adapter(tmp_path / "rs", rank=4), lora_alpha=8, use_rslora=True))
    assert {t.scaling for t in rs.tensors} == {8 / math.sqrt(4)}


def test_rank_pattern_per_module(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "p", rank=4, modules=("q_proj",))
    tensors = {f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_{h}.weight":
               np.zeros((2, HIDDEN) if h == "A" else (32, 2), dtype=np.float32) for i in range(LAYERS) for h in "AB"}
    from safetensors.numpy import load_file

    save_file({**load_file(str(path / "adapter_model.safetensors")), **tensors}, str(path / "adapter_model.safetensors"))
    _edit_config(path, rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 4})
    spec = read_adapter(path)
    ranks = {(t.module, t.rank, t.scaling) for t in spec.tensors}
    assert ranks == {("q_proj", 4, 2.0), ("v_proj", 2, 2.0)} and spec.rank == 4


def test_a_folder_saved_by_peft(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from tests.support.tiny_lora import make_peft_adapter
    from tests.support.tiny_models import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    spec = read_adapter(make_peft_adapter(base, tmp_path / "lora", rank=4))
    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (config.get("head_dim") or hidden // config["num_attention_heads"])
    q = config["num_attention_heads"] * (config.get("head_dim") or hidden // config["num_attention_heads"])
    inter = config["intermediate_size"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    check_adapter(spec, [ModuleShape(n, i, o, layers) for n, (i, o) in shapes.items()], max_rank=4)
    assert spec.targets == tuple(sorted(shapes)) and len(spec.tensors) == 7 * layers
