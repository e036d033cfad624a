"""bench/gpu_kernels.py's plumbing on the CPU (``--smoke``: the Triton interpreter, two candidates
each, the tiny shape): every section (skinny, attention, LoRA) runs and the tuned file follows from
the report by ``choose``, the same whether derived live or again from the saved report (``--from-json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository (this file is in tests/<part>/)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "bench/gpu_kernels.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_smoke_run_and_from_json_give_the_same_tuned_file(tmp_path: Path) -> None:
    proc = run("--smoke", "--shapes", "tiny", "--out", str(tmp_path / "k.md"), "--json", str(tmp_path / "k.json"),
               "--tuned-dir", str(tmp_path / "tuned"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "k.json").read_text())
    layers = {e["layer"] for e in report["skinny_candidates"]}
    assert layers == {"qkv", "o", "gate_up", "down"}   # the smoke head (256 x 64) is gate_up's shape: measured once
    assert all(len(e["candidates"]) == 2 for e in report["skinny_candidates"])
    assert {r["rows"] for r in report["skinny_rows_table"]} == {1, 2}
    assert report["attention_prefill"] and len(report["attention_decode"]) == 2
    tuned = json.loads((tmp_path / "tuned" / "CPU_smoke.json").read_text())
    assert tuned == report["tuned"] and tuned["device"] == "CPU (smoke)"
    assert set(tuned["attention"]) == {"4/2", "*"}
    for key, value in tuned["skinny"].items():   # kept only where it beat "cuBLAS" (torch here) at 1 row
        n, k = (int(v) for v in key.split("x"))
        rows = [r for r in report["skinny_rows_table"] if (r["n"], r["k"]) == (n, k)]
        assert rows[0]["skinny_s"] <= 0.97 * rows[0]["cublas_s"] and value[-1] in (1, 2)
    assert "## Skinny linears against cuBLAS" in (tmp_path / "k.md").read_text()
    modules = ("q/o", "k/v", "gate/up", "down")   # the LoRA section: measured, nothing tuned from it
    assert [(r["module"], r["rows"]) for r in report["lora"]] == [(m, n) for m in modules for n in (1, 2)]
    assert all(r[key] > 0 for r in report["lora"] for key in ("base_s", "triton_s", "torch_s", "blocks_s"))

    again = run("--from-json", str(tmp_path / "k.json"), "--out", str(tmp_path / "k2.md"), "--json",
                str(tmp_path / "k2.json"), "--tuned-dir", str(tmp_path / "tuned2"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "tuned2" / "CPU_smoke.json").read_text()) == tuned
    assert "| tiny | down | 64x128 | 2 |" in (tmp_path / "k2.md").read_text()
