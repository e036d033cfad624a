"""`jitney serve` refuses a model no code path can run at once: exit status 2
within seconds, the message naming the architecture and what it lacks, one
worker start, no crash loop. (A worker that crashes before Ready is restarted
five times with back-off: 62 s here before `jitney serve` gives up, measured with
a checkpoint missing a tensor; an unsupported model took that path before.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.server_harness import ROOT, free_port
from tests.support.tiny_hf_models import make_tiny_hf, make_tiny_mamba, make_tiny_t5

pytestmark = pytest.mark.slow

# Both processes import torch on a shared 2-core machine: ~8 s observed; far less than a crash loop.
REFUSED_WITHIN_SECONDS = 45.0


def _stablelm(path: Path) -> Path:
    return make_tiny_hf(path, "stablelm")


@pytest.mark.parametrize(("make", "named", "lacks"), [
    (make_tiny_t5, "T5ForConditionalGeneration", "encoder-decoder"),
    (make_tiny_mamba, "MambaForCausalLM", "layers of type linear_attention"),
    (_stablelm, "StableLmForCausalLM", "keyword arguments down to attention"),   # refused by the load's probe
], ids=["t5", "mamba", "stablelm"])
def test_serve_exits_2_at_once_naming_the_architecture(tmp_path: Path, make: Any, named: str, lacks: str) -> None:
    model = make(tmp_path / "model")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "jitney.cli", "serve", "--model", str(model), "--port", str(free_port()),
         "--no-standby-worker", "--no-weights-cache"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    assert took < REFUSED_WITHIN_SECONDS, took
    said = [line for line in done.stderr.splitlines() if line.startswith("jitney serve: cannot serve this model")]
    assert len(said) == 1, done.stderr[-3000:]
    assert named in said[0] and lacks in said[0], said[0]
    assert done.stderr.count("ERROR jitney.worker: cannot serve this model") == 1   # one worker, never restarted
    assert "starting another" not in done.stderr
