"""bench/lora_serving.py's inputs: the adapters it writes are ones the server
accepts, and its workloads name them the way `jitney bench` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lora_serving import WORKLOAD, workload_with_adapters, write_adapter
from jitney.client.bench import load_workload
from jitney.common.lora_adapter import ModuleShape, check_adapter, read_adapter


def test_written_adapter_is_a_valid_peft_folder_of_the_given_shapes(tmp_path: Path) -> None:
    modules = {"q_proj": (16, 16), "k_proj": (16, 8), "down_proj": (24, 16)}
    spec = read_adapter(write_adapter(tmp_path / "a", 4, 0, modules, 2))
    assert spec.rank == 4 and {(t.layer, t.module) for t in spec.tensors} == {
        (layer, m) for layer in range(2) for m in modules}
    shapes = [ModuleShape(name, i, o, 2) for name, (i, o) in modules.items()]
    check_adapter(spec, shapes, max_rank=16)
    # the same folder against another model's shapes is refused: the shapes were really written
    with pytest.raises(ValueError, match="k_proj"):
        check_adapter(spec, [ModuleShape(name, i, o if name != "k_proj" else 16, 2)
                             for name, (i, o) in modules.items()], max_rank=16)


def test_mix_workload_spreads_requests_over_adapters_and_bench_reads_them(tmp_path: Path) -> None:
    mix = load_workload(workload_with_adapters(WORKLOAD, tmp_path / "mix.jsonl", ["a0", "a1", "a2"], 7))
    plain = load_workload(workload_with_adapters(WORKLOAD, tmp_path / "plain.jsonl", [], 7))
    assert len(mix) == len(plain) == 7
    assert sorted(i.lora_adapter for i in mix) == ["a0", "a0", "a0", "a1", "a1", "a2", "a2"]
    assert all(i.lora_adapter == "" for i in plain)
    assert [i.prompt_token_ids for i in mix] == [i.prompt_token_ids for i in plain]


def test_workload_line_with_a_non_string_adapter_is_refused(tmp_path: Path) -> None:
    line = {"id": "x", "arrival_s": 0, "prompt_token_ids": [1, 2], "max_tokens": 3, "lora_adapter": 5}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: .*lora_adapter"):
        load_workload(path)
