"""The dependency rule between Jitney's parts (docs/architecture.md), checked on the source.

Every import of every module is read from its syntax tree, including imports
inside functions, and checked against the parts that module may depend on
(``ALLOWED``): between the installed parts (the stubs, common, client,
scheduler, worker), and inside each process between its sub-packages, so
that the arrows of docs/architecture.md point one way:

    scheduler: core <- api <- router; security <- api; main, lifecycle and launch over all
    worker:    kernels <- attention <- layers <- models <- loading, distributed <- runner <- main

bench/ may use any jitney part and the test support code (tests/support), never a
test file; a test file may import tests/support, never another test file.
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
                "client": "jitney.client", "bench": "bench", "tests": "tests"}

STUBS_AND_COMMON = {"jitney.common", "jitney.engine"}
# Part -> the Jitney parts its modules may import (a part always may import itself).
ALLOWED: dict[str, set[str]] = {
    "jitney.v1": set(),
    "jitney.engine": set(),
    "jitney.common": set(),
    "jitney.client": {"jitney.v1"},
    # The scheduler process: its core knows no door; the doors (api) share the core and
    # security; the router reads requests as the doors do; main and lifecycle wire them all.
    "jitney.scheduler": {"jitney.scheduler", "jitney.v1"} | STUBS_AND_COMMON,
    "jitney.scheduler.core": {"jitney.v1"} | STUBS_AND_COMMON,
    "jitney.scheduler.security": {"jitney.common"},
    "jitney.scheduler.api": {"jitney.scheduler.core", "jitney.scheduler.security", "jitney.v1"} | STUBS_AND_COMMON,
    "jitney.scheduler.router": {"jitney.scheduler.api", "jitney.scheduler.core.request", "jitney.scheduler.security",
                                "jitney.v1", "jitney.common"},
    "jitney.scheduler.launch": {"jitney.scheduler", "jitney.common"},
    # The worker process, bottom to top: kernels, attention, layers, models, then what
    # loads, shards and runs them.
    "jitney.worker": {"jitney.worker"} | STUBS_AND_COMMON,
    "jitney.worker.kernels": {"jitney.worker.config"} | STUBS_AND_COMMON,
    "jitney.worker.attention": {"jitney.worker.kernels"} | STUBS_AND_COMMON,
    "jitney.worker.layers": {"jitney.worker.kernels", "jitney.worker.attention"} | STUBS_AND_COMMON,
    "jitney.worker.models": {"jitney.worker.kernels", "jitney.worker.attention", "jitney.worker.layers"}
    | STUBS_AND_COMMON,
    "jitney.worker.loading": {"jitney.worker.kernels", "jitney.worker.attention", "jitney.worker.layers",
                              "jitney.worker.models", "jitney.worker.distributed.sharding"} | STUBS_AND_COMMON,
    "jitney.worker.distributed": {"jitney.worker.layers", "jitney.worker.models", "jitney.worker.config",
                                  "jitney.worker.runner"}
    | STUBS_AND_COMMON,
    "jitney.worker.runner": {"jitney.worker"} | STUBS_AND_COMMON,
    "jitney.cli": {"jitney.client"},
    "jitney": set(),
    "bench": {"jitney", "tests.support"},
    "tests": {"jitney", "bench", "tests.support"},
    "tests.support": {"jitney", "bench"},
}
# Imports these parts may make only inside a function (dispatched lazily).
LAZY_ALLOWED: dict[str, set[str]] = {"jitney.cli": {"jitney"}}
OLD_ROOTS = {"scheduler", "worker", "client"}
JITNEY_ROOTS = {"jitney", "bench", "tests"} | OLD_ROOTS


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
            found.append(f"{where} (not under the jitney root)")
            continue
        if root == "tests" and not (target == "tests.support" or target.startswith("tests.support.")):
            found.append(f"{where} (a test file; shared test code lives in tests/support)")
            continue
        allowed = ALLOWED[part] | {part} | (set() if top else LAZY_ALLOWED.get(part, set()))
        if not any(target == a or target.startswith(a + ".") for a in allowed):
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
    ("jitney.client.client", "from jitney.scheduler.core.config import SchedulerConfig\n", "jitney.scheduler"),
    ("jitney.client.cli", "def f():\n    import jitney.worker.main\n", "jitney.worker"),
    ("jitney.worker.runner.model_runner", "from jitney.scheduler import plan\n", "jitney.scheduler"),
    ("jitney.worker.runner.model_runner", "from jitney.v1 import generation_pb2\n", "jitney.v1"),
    ("jitney.scheduler.core.engine", "import jitney.worker.runner.model_runner\n", "jitney.worker"),
    ("jitney.common.model_files", "from jitney.engine.v1 import engine_pb2\n", "jitney.engine"),
    ("jitney.cli", "from jitney.scheduler.main import run_scheduler\n", "jitney.scheduler"),
    ("bench.gpu", "from tests.test_runner import Driver\n", "a test file"),
    ("tests.test_layer_stack", "from tests.test_runner import BLOCK\n", "a test file"),
    ("jitney.scheduler.core.engine", "from jitney.scheduler.api.validation import ModelLimits\n",
     "jitney.scheduler.api"),
    ("jitney.scheduler.security.keys", "from jitney.scheduler.core.request import Request\n",
     "jitney.scheduler.core"),
    ("jitney.worker.kernels.cpu.ops", "from jitney.worker.models.llama import ModelConfig\n",
     "jitney.worker.models"),
    ("jitney.worker.layers.ops", "from jitney.worker.runner.sampler import sample_step\n",
     "jitney.worker.runner"),
    ("jitney.scheduler.core.engine", "from scheduler.config import SchedulerConfig\n", "not under the jitney root"),
])
def test_the_checker_catches_a_broken_rule(module: str, source: str, fragment: str) -> None:
    found = violations_in(module, source)
    assert len(found) == 1 and fragment in found[0]


def test_the_checker_allows_what_the_rule_allows() -> None:
    assert violations_in("jitney.cli", "def f():\n    from jitney.scheduler.main import run_scheduler\n") == []
    assert violations_in("jitney.scheduler.api.servicer", "from jitney.engine.v1 import engine_pb2\n") == []
    assert violations_in("jitney.worker.loading.loader", "from jitney.common.model_files import resolve_model\n") == []
    assert violations_in("bench.gpu", "from jitney.worker.runner.model_runner import ModelRunner\n") == []
    assert violations_in("bench.soak", "from tests.support.soak_load import Soak\n") == []
    assert violations_in("tests.test_e2e", "from tests.support.server_harness import running_server\n") == []
    assert violations_in("jitney.scheduler.api.servicer", "from jitney.scheduler.core.engine import Engine\n") == []
    assert violations_in("jitney.worker.models.llama", "from jitney.worker.layers.ops import TorchLayerOps\n") == []
