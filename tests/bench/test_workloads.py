"""The shipped benchmark workloads (bench/workloads/) are what their generator makes.

No model and no server: the random workloads take milliseconds; spec-edit-32
needs the default model's tokenizer (about 3 s from the weights cache, 9 s
the first time, when the GGUF vocabulary is converted).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.workloads import generate
from jitney.client.bench import load_workload

FOLDER = Path(generate.__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(generate.RANDOM_WORKLOADS))
def test_random_workload_regenerates_byte_identical(name: str) -> None:
    shipped = (FOLDER / f"{name}.jsonl").read_bytes()
    assert generate.shipped_text(name).encode() == shipped, f"bench/workloads/{name}.jsonl drifted from its seed"


def test_spec_edit_regenerates_byte_identical() -> None:
    shipped = (FOLDER / "spec-edit-32.jsonl").read_bytes()
    assert generate.shipped_text("spec-edit-32").encode() == shipped


def test_every_shipped_workload_is_generated_and_loads() -> None:
    """No file in the folder without a recipe, and each one reads as `jitney bench` reads it."""
    on_disk = {p.stem for p in FOLDER.glob("*.jsonl")}
    assert on_disk == set(generate.SHIPPED)
    counts = {name: len(load_workload(FOLDER / f"{name}.jsonl")) for name in generate.SHIPPED}
    assert counts == {"offline-64": 64, "online-64": 64, "prefix-64": 64, "spec-edit-32": 32}


def test_shapes_of_the_random_workloads() -> None:
    """What the README of bench/workloads promises about each file."""
    rows = {name: spec.requests() for name, spec in generate.RANDOM_WORKLOADS.items()}
    assert {r["arrival_s"] for r in rows["offline-64"]} == {0.0}
    online = [r["arrival_s"] for r in rows["online-64"]]
    assert online == sorted(online) and online[0] > 0 and 50 < online[-1] < 100   # ~1 a second
    prefix = rows["prefix-64"][0]["prompt_token_ids"][:384]
    assert all(r["prompt_token_ids"][:384] == prefix for r in rows["prefix-64"])
    for name, spec in generate.RANDOM_WORKLOADS.items():
        for r in rows[name]:
            assert 8 <= len(r["prompt_token_ids"]) - spec.shared_prefix <= spec.prompt_max
            assert 4 <= r["max_tokens"] <= spec.out_max
            assert all(generate.VOCAB_LO <= t < generate.VOCAB_HI for t in r["prompt_token_ids"])


def test_seeds_differ_and_repeat() -> None:
    a, b = generate.RandomSpec(seed=1, n=4), generate.RandomSpec(seed=2, n=4)
    assert a.requests() == generate.RandomSpec(seed=1, n=4).requests()
    assert a.requests() != b.requests()


def test_random_command_prints_a_workload(tmp_path: Path) -> None:
    """The command bench/run_benchmarks.py uses for streams-32x128: every output exactly 128 tokens."""
    out = tmp_path / "streams.jsonl"
    subprocess.run([sys.executable, str(FOLDER / "generate.py"), "random", "-n", "32", "--out-median", "1000000",
                    "--out-max", "128", "-o", str(out)], check=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 32 and {r["max_tokens"] for r in rows} == {128}
    printed = subprocess.run([sys.executable, str(FOLDER / "generate.py"), "random", "--seed", "7"],
                             check=True, capture_output=True, text=True).stdout
    assert printed == (FOLDER / "offline-64.jsonl").read_text()   # offline-64 is the defaults at seed 7


def test_write_command_rejects_an_unknown_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(FOLDER / "generate.py"), "write", "--out", str(tmp_path), "nope"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown workload" in done.stderr
    assert not list(tmp_path.iterdir())
