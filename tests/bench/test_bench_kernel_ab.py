"""bench/kernel_ab.py: the builds it loads beside the worker's own must not register into ``jitney_cpu``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bench.kernel_ab import renamed, sources

ROOT = Path(__file__).resolve().parents[2]   # the repository
CSRC = ROOT / "worker" / "kernels" / "cpu" / "csrc"


def test_the_working_tree_sources_are_csrc_s_files() -> None:
    files = sources("WORK")
    assert set(files) == {f.name for f in CSRC.iterdir() if f.suffix in (".cpp", ".h")}
    assert files["library.cpp"] == (CSRC / "library.cpp").read_bytes()


def test_every_registration_is_renamed() -> None:
    files = sources("WORK")
    out = renamed(files, "jitney_ab7")
    registrations = re.compile(rb"TORCH_LIBRARY\w*\(\s*(\w+)")
    before = [m.group(1) for text in files.values() for m in registrations.finditer(text)]
    after = [m.group(1) for text in out.values() for m in registrations.finditer(text)]
    # One library and its fragments today; any registration added later must be caught too.
    assert before and set(before) == {b"jitney_cpu"}
    assert after == [b"jitney_ab7"] * len(before)
    # Nothing else changes: the C++ namespace jitney_cpu (headers) stays as it is.
    for name, text in files.items():
        assert registrations.sub(b"", out[name]) == registrations.sub(b"", text)


def test_a_git_ref_s_sources() -> None:
    root = ROOT
    try:
        head = subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = sources(head)
    tracked = subprocess.check_output(["git", "-C", str(root), "ls-tree", "--name-only", f"{head}:worker/kernels/cpu/csrc"],
                                      text=True).split()
    assert set(files) == {n for n in tracked if n.endswith((".cpp", ".h"))}
    assert "library.cpp" in files
