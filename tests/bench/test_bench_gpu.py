"""bench/gpu.py's plumbing on the CPU: the tiny shape, 4 requests in offline-64's format.

The GPU benchmark itself runs on a GPU machine (../shared/gpu/README.md);
this keeps every section of it (servers + `jitney bench` + step traces, the
worker's decode and prefill steps, transformers' continuous batching, the
invariance section, the report) running in `make test`, so it cannot rot.
The invariance section runs alone (``--invariance``, as on the GPU), with
its CPU sizes: 4 prompts, 24 requests of 6 tokens, budgets 2048 and 16, one
off/on round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]   # the repository (this file is in tests/<part>/)
LIMIT = 4

pytestmark = pytest.mark.slow


def write_workload(folder: Path) -> Path:
    """An offline-64.jsonl of LIMIT requests (all at t = 0), so the test needs no ../shared."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"r{i:04d}", "arrival_s": 0.0, "prompt_token_ids": [(97 * i + 13 * j) % 40000 + 5 for j in range(8 + 5 * i)],
             "max_tokens": 6 + 3 * i} for i in range(LIMIT)]
    (folder / "offline-64.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def run_bench(tmp: Path, *sections: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """bench/gpu.py on the CPU with ``sections``' flags; its report and JSON go to ``tmp``."""
    cmd = [sys.executable, "bench/gpu.py", "--device", "cpu", "--limit", str(LIMIT), *sections,
           "--workload-dir", str(write_workload(tmp / "workloads")),
           "--out", str(tmp / "x.md"), "--json", str(tmp / "x.json"), "--workdir", str(tmp / "work"),
           "--budget-s", "100"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    return done, tmp


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    # the invariance section: its own run below
    return run_bench(tmp_path_factory.mktemp("gpu_bench"), "--shape", "tiny:offline,decode,prefill,hf")


def test_cpu_plumbing_runs(bench_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, tmp = bench_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads((tmp / "x.json").read_text())
    assert not data["errors"], data["errors"]
    assert not [s for s in data["skipped"] if "budget" in s], data["skipped"]
    tiny = data["shapes"]["tiny"]

    offline = tiny["offline"]
    assert [c["case"] for c in offline] == ["default", "static-8"]
    for case in offline:
        assert case["wall_s"] > 0 and case["completed"] == case["requests"] == LIMIT, case
        assert case["output_tok_s"] > 0 and case["ttft_s"]["p50"] > 0
        assert case["steps"] > 0 and case["max_step_s"] > 0 and len(case["first_steps_s"]) == 2
        assert any("jitney: ready on" in line for line in case["startup_lines"]), case["startup_lines"]

    assert [row["batch"] for row in tiny["decode"]] == [1, 2]
    for row in tiny["decode"]:
        assert 0 < row["execute_s_min"] <= row["execute_s_median"], row
        assert row["graph_s"] is None and row["graph_note"]        # no CUDA graphs on CPU: "n/a"
    (prefill,) = tiny["prefill"]
    assert prefill["tokens"] == 64 and prefill["execute_s_median"] > 0 and prefill["first_s"] > 0

    # transformers' continuous batching runs on CPU too; where it cannot, it is skipped with its reason.
    if "hf" in tiny:
        assert tiny["hf"]["wall_s"] > 0 and tiny["hf"]["completed"] == LIMIT
    else:
        assert any(s.startswith("tiny hf:") for s in data["skipped"]), data["skipped"]


def test_cpu_report_has_the_tables(bench_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, tmp = bench_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = (tmp / "x.md").read_text()
    for heading in ("# Jitney GPU benchmark: CPU", "## offline-64", "## Decode step", "## Prefill step",
                    "## Server start-up lines", "## Skipped"):
        assert heading in report, heading
    assert "| tiny | default |" in report and "| tiny | static-8 |" in report
    assert "| tiny | 1 |" in report and "| tiny | 64 |" in report
    assert "torch " in report and "transformers " in report



# ---- the invariance section (--batch-invariant off and on) ----

@pytest.fixture(scope="module")
def invariance_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    return run_bench(tmp_path_factory.mktemp("gpu_bench_invariance"), "--invariance")


def test_cpu_invariance_section(invariance_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, tmp = invariance_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads((tmp / "x.json").read_text())
    assert not data["errors"], data["errors"]
    assert not data["skipped"], data["skipped"]
    assert list(data["shapes"]) == ["tiny"] and list(data["shapes"]["tiny"]) == ["invariance"]
    inv = data["shapes"]["tiny"]["invariance"]
    assert inv["config"]["prompt_tokens"] == [1, 3, 12, 40] and inv["config"]["requests"] == 24

    assert [(r["batch_invariant"], r["budget"]) for r in inv["rows"]] == [
        (False, 2048), (False, 16), (True, 2048), (True, 16)]
    for row in inv["rows"]:
        assert row["requests"] == 24 and row["preemptions"] == 2 and row["cached_prompt_tokens"] > 0, row
        assert row["largest_step_seqs"] > 1 and row["steps"] > 0
        assert row["tokens_differ"] <= row["logprobs_differ"] <= row["requests"]
        if row["batch_invariant"]:   # the CPU path: bit-identical to the alone runs
            assert (row["tokens_differ"], row["logprobs_differ"], row["examples"]) == (0, 0, []), row
    assert [(r["batch_invariant"], r["resolved"]) for r in inv["runners"]] == [(False, False), (True, True)]

    # the cost: decode at batch 1 and 2 (64, capped by --limit) and the 64-token prefill, off and on
    assert [(r["what"], r["batch_invariant"]) for r in inv["steps"]] == [
        (w, f) for f in (False, True) for w in ("decode batch 1", "decode batch 2", "prefill 64 tokens")]
    assert all(0 < r["execute_s_min"] <= r["execute_s_median"] for r in inv["steps"])
    assert [(c["case"], c["flags"]) for c in inv["offline"]] == [
        ("invariant-off-1", ["--no-batch-invariant"]), ("invariant-on-1", ["--batch-invariant"])]
    for case in inv["offline"]:
        assert case["wall_s"] > 0 and case["completed"] == case["requests"] == LIMIT, case
    assert any("batch-invariant on" in line for line in inv["offline"][1]["startup_lines"])
    assert any("batch-invariant off" in line for line in inv["offline"][0]["startup_lines"])
    walls = [c["wall_s"] for c in inv["offline"]]
    assert inv["offline_wall_ratio"] == pytest.approx(walls[1] / walls[0])

    report = (tmp / "x.md").read_text()
    assert "## Batch invariance" in report and "### What it costs" in report
    assert "| tiny | on | all | 48 | 0 | 0 |" in report
    assert "| tiny | decode batch 1, ms |" in report and "| tiny | offline-64 wall (median), s |" in report
    assert "| tiny | invariant-on-1 | `--batch-invariant` |" in report
    assert "0 of 48 batched requests differ" in report and "a CPU run" in report


def test_invariance_flag_picks_the_shapes() -> None:
    """--invariance alone: 1b and 135m on CUDA, tiny on CPU; with --shape it adds the section."""
    from bench.gpu import SECTIONS, build_parser, fill_defaults

    def shapes(*argv: str) -> list[tuple[str, list[str]]]:
        return list(fill_defaults(build_parser().parse_args(list(argv))).shape)

    assert shapes("--invariance") == [("1b", ["invariance"]), ("135m", ["invariance"])]
    assert shapes("--invariance", "--device", "cpu") == [("tiny", ["invariance"])]
    assert shapes("--invariance", "--shape", "1b:decode") == [("1b", ["decode", "invariance"])]
    assert shapes("--shape", "1b") == [("1b", list(SECTIONS))] and "invariance" in SECTIONS
    args = fill_defaults(build_parser().parse_args(["--invariance"]))
    assert (args.invariance_requests, args.invariance_budgets, args.invariance_rounds) == (180, [2048, 256], 2)
