"""bench/gpu.py's plumbing on the CPU: the tiny shape, 4 requests in offline-64's format.

The GPU benchmark itself runs on a GPU machine (../shared/gpu/README.md);
this keeps every section of it (servers + `jitney bench` + step traces, the
worker's decode and prefill steps, transformers' continuous batching, the
report) running in `make test`, so it cannot rot.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4

pytestmark = pytest.mark.slow


def write_workload(folder: Path) -> Path:
    """An offline-64.jsonl of LIMIT requests (all at t = 0), so the test needs no ../shared."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"r{i:04d}", "arrival_s": 0.0, "prompt_token_ids": [(97 * i + 13 * j) % 40000 + 5 for j in range(8 + 5 * i)],
             "max_tokens": 6 + 3 * i} for i in range(LIMIT)]
    (folder / "offline-64.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("gpu_bench")
    cmd = [sys.executable, "bench/gpu.py", "--device", "cpu", "--limit", str(LIMIT), "--shape", "tiny",
           "--workload-dir", str(write_workload(tmp / "workloads")),
           "--out", str(tmp / "x.md"), "--json", str(tmp / "x.json"), "--workdir", str(tmp / "work"),
           "--budget-s", "100"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    return done, tmp


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

