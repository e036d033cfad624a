"""The shape of the source tree (docs/architecture.md, "Packages"): files small enough to
read whole, every package listed for the wheel, test helpers under tests/support."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
SOURCE_FOLDERS = ("jitney", "scheduler", "worker", "client", "bench", "tests", "protos")
SUFFIXES = {".py", ".cpp", ".h", ".sh"}


def _generated(path: Path) -> bool:
    return "_pb2" in path.name


def test_no_source_file_is_over_600_lines() -> None:
    long = {}
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in SUFFIXES and path.is_file() and not _generated(path):
                lines = path.read_text(errors="replace").count("\n")
                if lines > MAX_LINES:
                    long[str(path.relative_to(ROOT))] = lines
    assert long == {}


def test_every_package_is_in_the_wheel() -> None:
    """A folder with an ``__init__.py`` that pyproject's package list lacks would be left
    out of the wheel (and only an installed copy would notice)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = config["package-dir"]
    found = {".".join((package, *init.parent.relative_to(ROOT / folder).parts))
             for package, folder in dirs.items() for init in (ROOT / folder).rglob("__init__.py")}
    assert found - listed == set()
    assert listed - found == set()


def test_test_helpers_live_under_tests() -> None:
    """bench/ holds benchmark scripts; what tests share (fakes, harnesses, tiny models)
    is in tests/support/, which bench/ may use too."""
    helpers = [p.name for p in (ROOT / "tests").glob("*.py")
               if p.name not in ("__init__.py", "conftest.py") and not p.name.startswith("test_")]
    assert helpers == []
