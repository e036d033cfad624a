"""The dependency rule between Jitney's parts (docs/architecture.md), checked on the source.

Every import of every module is read from its syntax tree, including imports
inside functions, and checked against the parts that module may depend on:

    jitney.v1, jitney.engine   generated stubs: nothing of Jitney's but themselves
    jitney.common              itself only
    jitney.client              itself and the public stubs (jitney.v1)
    jitney.scheduler           itself, common, the engine contract, jitney.v1
    jitney.worker              itself, common, the engine contract
    jitney.cli                 jitney.client at module level; the rest only inside functions (lazily)
    bench/                     any jitney part, never tests/

Nothing anywhere imports the old top-level names (``scheduler``, ``worker``, ``client``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Source folder -> the package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {"jitney": "jitney", "scheduler": "jitney.scheduler", "worker": "jitney.worker",
                "client": "jitney.client", "bench": "bench"}

# Part -> the Jitney parts its modules may import (a part always may import itself).
ALLOWED: dict[str, set[str]] = {
    "jitney.v1": set(),
    "jitney.engine": set(),
    "jitney.common": set(),
    "jitney.client": {"jitney.v1"},
    "jitney.scheduler": {"jitney.common", "jitney.engine", "jitney.v1"},
    "jitney.worker": {"jitney.common", "jitney.engine"},
    "jitney.cli": {"jitney.client"},
    "jitney": set(),
    "bench": {"jitney"},
}
# Imports these parts may make only inside a function (dispatched lazily).
LAZY_ALLOWED: dict[str, set[str]] = {"jitney.cli": {"jitney"}}
OLD_ROOTS = {"scheduler", "worker", "client", "tests"}
JITNEY_ROOTS = {"jitney", "bench"} | OLD_ROOTS


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGE_DIRS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """The longest key of ALLOWED that ``module`` is inside."""
    best = ""
    for part in ALLOWED:
        if (module == part or module.startswith(part + ".")) and len(part) > len(best):
            best = part
    return best


def _imports(tree: ast.Module) -> Iterator[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every import in ``tree``."""
    def walk(node: ast.AST, top: bool) -> Iterator[tuple[str, bool, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top, child.lineno
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, top, child.lineno
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)
    yield from walk(tree, True)


def violations_in(module: str, source: str) -> list[str]:
    """Imports in ``source`` (the text of ``module``) that break the rule."""
    part = part_of(module)
    if not part:
        return []
    found = []
    for target, top, line in _imports(ast.parse(source)):
        root = target.split(".")[0]
        if root not in JITNEY_ROOTS:
            continue
        where = f"{module}:{line} imports {target}"
        if root in OLD_ROOTS:
            found.append(f"{where} (not under the jitney root)" if root != "tests" else f"{where} (test code)")
            continue
        target_part = part_of(target) or target
        allowed = ALLOWED[part] | {part} | (set() if top else LAZY_ALLOWED.get(part, set()))
        if not any(target_part == a or target_part.startswith(a + ".") for a in allowed):
            found.append(f"{where} ({part} may import {sorted(allowed)})")
    return found


def source_files() -> Iterator[Path]:
    for folder in PACKAGE_DIRS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_module_keeps_the_dependency_rule() -> None:
    problems = [v for path in source_files() for v in violations_in(module_name(path), path.read_text())]
    assert problems == []


def test_every_source_module_belongs_to_a_part() -> None:
    unowned = [module_name(p) for p in source_files() if not part_of(module_name(p))]
    assert unowned == []


@pytest.mark.parametrize("module, source, fragment", [
    ("jitney.client.client", "from jitney.scheduler.config import SchedulerConfig\n", "jitney.scheduler"),
    ("jitney.client.cli", "def f():\n    import jitney.worker.main\n", "jitney.worker"),
    ("jitney.worker.runner", "from jitney.scheduler import plan\n", "jitney.scheduler"),
    ("jitney.worker.runner", "from jitney.v1 import generation_pb2\n", "jitney.v1"),
    ("jitney.scheduler.engine", "import jitney.worker.runner\n", "jitney.worker"),
    ("jitney.common.model_files", "from jitney.engine.v1 import engine_pb2\n", "jitney.engine"),
    ("jitney.cli", "from jitney.scheduler.main import run_scheduler\n", "jitney.scheduler"),
    ("bench.gpu", "from tests.fake_worker import FakeWorker\n", "test code"),
    ("jitney.scheduler.engine", "from scheduler.config import SchedulerConfig\n", "not under the jitney root"),
])
def test_the_checker_catches_a_broken_rule(module: str, source: str, fragment: str) -> None:
    found = violations_in(module, source)
    assert len(found) == 1 and fragment in found[0]


def test_the_checker_allows_what_the_rule_allows() -> None:
    assert violations_in("jitney.cli", "def f():\n    from jitney.scheduler.main import run_scheduler\n") == []
    assert violations_in("jitney.scheduler.server", "from jitney.engine.v1 import engine_pb2\n") == []
    assert violations_in("jitney.worker.loader", "from jitney.common.model_files import resolve_model\n") == []
    assert violations_in("bench.gpu", "from jitney.worker.runner import ModelRunner\n") == []
