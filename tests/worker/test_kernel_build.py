"""The CPU kernels' build folder: a build that was killed part way (torch's ``lock``
file left behind) must not make every later start wait forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from jitney.worker.kernels.cpu import ops as cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    cpu_kernels.load()                      # built here (at install, in make test)
    built = cpu_kernels.cache_dir()
    copy = tmp_path / built.name            # the same key under another cache root
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "jitney.lock"))
    (copy / "lock").touch()                 # what a build killed inside torch's baton leaves
    env = {**os.environ, "JITNEY_KERNEL_CACHE": str(tmp_path)}
    code = ("from jitney.worker.kernels.cpu import ops; ops.load(); "
            "import torch; assert hasattr(torch.ops.jitney_cpu, 'linear'); print(ops.cache_dir())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(copy)
    assert not (copy / "lock").exists()
    assert "left by a kernel build that did not finish" in done.stderr
