"""bench/gpu.py's plumbing: the import root, the budget, the run's record, progress lines, the workloads."""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jitney.client.bench import WorkItem

ROOT = Path(__file__).resolve().parent.parent.parent


# ---------------------------------------------------------------- import root

def ensure_jitney_importable() -> str | None:
    """Make ``jitney.*`` importable here and in child processes; the link tree made, if any.

    Installed, the package maps scheduler/, worker/ and client/ into
    ``jitney``; the checkout's jitney/ folder alone has none of them. The
    servers run ``python -m jitney.cli`` in the repository root
    (tests/support/server_harness.py), and ``-m`` puts the current folder first on
    sys.path, so that bare folder would shadow an installed wheel:
    PYTHONSAFEPATH=1 (Python >= 3.11) keeps the children from doing so.
    Without any install (only the repository on PYTHONPATH), a tree of links
    like ``make typecheck``'s is made and put first on sys.path and PYTHONPATH.
    """
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        import jitney.client  # noqa: F401
        import jitney.scheduler  # noqa: F401
        import jitney.worker  # noqa: F401
        return None
    except ModuleNotFoundError:
        pass
    tree = Path(tempfile.mkdtemp(prefix="jitney-import-"))
    (tree / "jitney").mkdir()
    for entry in (ROOT / "jitney").iterdir():
        if entry.name != "__pycache__":
            (tree / "jitney" / entry.name).symlink_to(entry)
    for part in ("scheduler", "worker", "client"):
        (tree / "jitney" / part).symlink_to(ROOT / part)
    for name in [m for m in sys.modules if m == "jitney" or m.startswith("jitney.")]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    paths = [str(tree), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    return str(tree)


# ---------------------------------------------------------------- plumbing

@dataclass
class Budget:
    """Wall-clock budget of the whole run."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def allows(self, reserve: float) -> bool:
        return self.left() >= reserve


@dataclass
class Run:
    """What the run measured, for the report and the JSON file."""

    args: argparse.Namespace
    budget: Budget
    workdir: Path
    meta: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    triton_cache: str | None = None   # the offline cases' cache, warm once they ran

    def shape(self, name: str) -> dict[str, Any]:
        return self.shapes.setdefault(name, {})

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        log(f"-- skipped {what}: {why}")

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "shapes": self.shapes, "skipped": self.skipped, "errors": self.errors,
                "notes": self.notes}


_STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress, with the seconds since the start."""
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {message}", flush=True)


def is_cuda(args: argparse.Namespace) -> bool:
    return bool(args.device == "cuda")


def dtype_name(args: argparse.Namespace) -> str:
    return "bfloat16" if is_cuda(args) else "float32"


def free_device_memory(args: argparse.Namespace) -> None:
    gc.collect()
    if is_cuda(args):
        import torch

        torch.cuda.empty_cache()


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "n/a"


def machine_meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    card = torch.cuda.get_device_name() if is_cuda(args) else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {"card": card, "device": args.device, "dtype": dtype_name(args), "torch": torch.__version__,
            "triton": version_of("triton"), "transformers": version_of("transformers"),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "budget_s": args.budget_s, "limit": args.limit}


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or leave alone, for ``None``) one environment variable for the block."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and old is None:
            os.environ.pop(name, None)
        elif value is not None and old is not None:
            os.environ[name] = old


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads (process-wide) set to ``n`` in the block; ``None`` leaves them.
    On the CPU the tiny model's steps are thread hand-offs: one thread runs them several times faster."""
    if n is None:
        yield
        return
    from tests.support.invariance_driver import torch_threads

    with torch_threads(n):
        yield


# ---------------------------------------------------------------- workloads

def load_items(args: argparse.Namespace, name: str) -> list[WorkItem]:
    from jitney.client.bench import load_workload

    items = load_workload(Path(args.workload_dir) / name)
    return items[: args.limit] if args.limit else items


def write_items(items: list[WorkItem], path: Path) -> Path:
    rows = [{"id": i.id, "arrival_s": i.arrival_s, "prompt_token_ids": i.prompt_token_ids,
             "max_tokens": i.max_tokens} for i in items]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
