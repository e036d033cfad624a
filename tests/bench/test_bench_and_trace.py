"""`jitney bench`, the step trace (`serve --trace`) and `jitney plot`, on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jitney.scheduler.plot import assign_seats
from jitney.scheduler.core.trace import read_trace
from tests.support.server_harness import ROOT, running_server
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow


def _workload(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    lines = [json.dumps({"id": f"r{i}", "arrival_s": t, "prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(p)],
                         "max_tokens": m}) for i, (t, p, m) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jitney.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_bench_trace_and_plot(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", max_position_embeddings=512)
    trace = tmp_path / "trace.jsonl"
    args = ["--model", str(model), "--num-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--dtype", "float32", "--trace", str(trace)]
    rows = [(0.0, 40, 12), (0.0, 5, 30), (0.0, 9, 7), (0.0, 20, 16), (0.0, 3, 9), (0.3, 11, 10)]
    workload = _workload(tmp_path / "w.jsonl", rows)
    with running_server(args, tmp_path) as server:
        out = tmp_path / "r.json"
        done = _cli("bench", "--target", server.target, "--workload", str(workload), "--json", str(out),
                    "--no-progress")
        assert done.returncode == 0, done.stdout + done.stderr
        summary = json.loads(out.read_text())
        assert (summary["requests"], summary["errors"]) == (6, 0)
        assert summary["output_tokens"] == sum(m for _, _, m in rows)
        assert summary["prompt_tokens"] == sum(p for _, p, _ in rows)
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
            assert 0 < summary[key]["p50"] <= summary[key]["p99"]
        assert "TTFT" in done.stdout
        # A request the server must refuse (beyond the context) is an error: exit 1.
        bad = _workload(tmp_path / "bad.jsonl", [(0.0, 10, 5), (0.0, 10, 100_000)])
        refused = _cli("bench", "--target", server.target, "--workload", str(bad), "--no-progress")
        assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr
    steps = read_trace(trace)
    assert steps and all(len(s["seats"]) <= 4 for s in steps)
    assert all(s["prefill_tokens"] + s["decode_tokens"] <= 32 for s in steps)
    assert sum(s["decode_tokens"] for s in steps) > 0 and max(s["kv_blocks_used"] for s in steps) > 0
    # The model ran (and was timed) in every step with seats; a step that only frees runs none.
    assert all(0 < s["model_s"] <= s["worker_s"] for s in steps if s["seats"])
    assert all(s["model_s"] == 0 for s in steps if not s["seats"])
    chart = tmp_path / "chart.png"
    drawn = _cli("plot", str(trace), str(trace), "--title", "a", "--title", "b", "-o", str(chart))
    assert drawn.returncode == 0, drawn.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seats_are_kept_while_riding_and_reused_after() -> None:
    steps = [{"seats": [1, 2]}, {"seats": [1, 2]}, {"seats": [2, 3]}, {"seats": [2, 3, 4]}, {"seats": []}]
    rows, num_seats = assign_seats(steps)
    assert num_seats == 3
    assert rows == [[1, 2], [1, 2], [3, 2], [3, 2, 4], []]


def test_percentiles_are_nearest_rank() -> None:
    from jitney.client.bench import _dist

    assert _dist([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == {"mean": 3.5, "p50": 3.0, "p90": 6.0, "p99": 6.0}
    d = _dist([float(v) for v in range(1, 101)])
    assert (d["p50"], d["p90"], d["p99"]) == (50.0, 90.0, 99.0)


def test_trace_counts_each_steps_attention_work(tmp_path: Path) -> None:
    """samples, context_tokens and attended_keys of one step, by hand: a 5-token prompt chunk from 0
    that samples, a decode at position 7, and a prompt chunk of 4 from 3 that does not sample."""
    from types import SimpleNamespace

    from jitney.scheduler.core.scheduler import ScheduledChunk, SchedulerOutput
    from jitney.scheduler.core.trace import StepTracer

    def chunk(seq: int, start: int, n: int, sample: bool) -> ScheduledChunk:
        return ScheduledChunk(request=SimpleNamespace(seq_id=seq), start_position=start,  # type: ignore[arg-type]
                              num_new_tokens=n, token_ids=[1] * n, new_block_ids=[], sample=sample)

    output = SchedulerOutput(step_id=1, scheduled=[chunk(1, 0, 5, True), chunk(2, 7, 1, True), chunk(3, 3, 4, False)],
                             num_batched_tokens=10)
    sched = SimpleNamespace(num_waiting=0, num_running=3, block_manager=SimpleNamespace(num_used_blocks=4))
    tracer = StepTracer(tmp_path / "t.jsonl")
    tracer.record(output, tracer.now(), 0.01, 0.005, sched)  # type: ignore[arg-type]
    tracer.close()
    (step,) = read_trace(tmp_path / "t.jsonl")
    assert (step["prefill_tokens"], step["decode_tokens"], step["samples"]) == (9, 1, 2)
    assert step["context_tokens"] == 5 + 8 + 7
    # positions 0-4 attend 1-5 keys, position 7 attends 8, positions 3-6 attend 4-7
    assert step["attended_keys"] == (1 + 2 + 3 + 4 + 5) + 8 + (4 + 5 + 6 + 7)
