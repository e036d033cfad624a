"""A worker that refuses its model (``REFUSED_EXIT_CODE``, its reason on the ready
pipe) ends `jitney serve` at once with status 2, where a crash before Ready is
retried with backoff (tests/scheduler/test_supervisor.py); and which path serves
the model reaches GetModelInfo, also from a worker older than the fields."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from jitney.common.supervision import READY_FD_ENV, REFUSED_BYTE, REFUSED_EXIT_CODE
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.api.servicer import implementation, invariance_guaranteed
from jitney.scheduler.launch.supervisor import _Supervisor

# A stand-in worker: logs its start, refuses (with a reason, or only by its status), exits.
WORKER = f"""
import os, sys, time
with open(sys.argv[1], "a") as log:
    log.write("start\\n")
if sys.argv[2] == "say":
    fd = int(os.environ["{READY_FD_ENV}"])
    os.write(fd, {REFUSED_BYTE!r} + "FooForCausalLM is not supported: it has layers of type mamba".encode())
    os.close(fd)
    time.sleep(float(sys.argv[3]))    # a worker's exit can take a while (torch's teardown)
sys.exit({REFUSED_EXIT_CODE})
"""


def _supervise(tmp_path: Path, how: str, linger: float = 0.0) -> tuple[int, int, float]:
    log = tmp_path / "starts"
    scheduler = [sys.executable, "-c", "import time; time.sleep(60)"]
    worker = [sys.executable, "-c", WORKER, str(log), how, str(linger)]
    started = time.monotonic()
    code = _Supervisor(scheduler, worker, max_worker_restarts=5, drain_seconds=1.0).run()
    return code, log.read_text().count("start"), time.monotonic() - started


@pytest.mark.parametrize("linger", [0.0, 30.0])
def test_a_refusal_with_its_reason_stops_serve_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], linger: float) -> None:
    code, starts, took = _supervise(tmp_path, "say", linger)
    assert (code, starts) == (2, 1)           # never restarted
    assert took < 10.0, took                  # not the worker's 30 s, nor the scheduler's 60 s
    err = capsys.readouterr().err
    assert "cannot serve this model: FooForCausalLM is not supported: it has layers of type mamba" in err


def test_a_refusal_by_status_alone_stops_serve_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, starts, _ = _supervise(tmp_path, "quiet")
    assert (code, starts) == (2, 1)
    assert "cannot serve this model: the worker refused it" in capsys.readouterr().err


def test_model_info_says_which_path_serves_the_model() -> None:
    fallback = engine_pb2.Ready(batch_invariant=True, model_implementation="transformers",
                                batch_invariance_guaranteed=False)
    native = engine_pb2.Ready(batch_invariant=True, model_implementation="native", batch_invariance_guaranteed=True)
    older = engine_pb2.Ready(batch_invariant=True)         # a worker from before the fields: native only
    assert [(implementation(r), invariance_guaranteed(r)) for r in (fallback, native, older)] == [
        ("transformers", False), ("native", True), ("native", True)]
    assert invariance_guaranteed(engine_pb2.Ready(batch_invariant=False)) is False
