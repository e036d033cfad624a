"""The served LoRA adapters, shared by both doors: ``--lora-modules`` at
start, the runtime load/unload calls (gRPC ``LoadLoraAdapter`` /
``UnloadLoraAdapter``, HTTP ``/v1/load_lora_adapter`` /
``/v1/unload_lora_adapter``), and the name a request selects one by.

The registry (core/lora.py) outlives a worker: each Ready (the first and
after a restart) checks every adapter again against the worker's modules
and rank bound. At the first, a ``--lora-modules`` adapter that does not fit
stops the server; after a restart one that no longer fits is dropped with a
warning. The new worker's slots start empty (its Scheduler is new).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jitney.common.lora_adapter import AdapterError, AdapterSpec, ModuleShape, read_adapter
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.engine import Engine
from jitney.scheduler.core.lora import Adapter, AdapterRegistry, name_problem
from jitney.scheduler.core.request import InvalidRequestError

log = logging.getLogger("jitney.scheduler")


class LoraCallError(Exception):
    """A refused load/unload: a grpc.StatusCode name, the request field and why."""

    def __init__(self, code: str, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.code, self.field, self.message = code, field, message


class LoraService:
    """``initial``: the ``--lora-modules`` adapters, (name, folder, spec) as read at start."""

    def __init__(self, initial: Sequence[tuple[str, str, AdapterSpec]] = ()) -> None:
        self.registry = AdapterRegistry()
        self._initial = list(initial)
        self._started = False
        self.num_loads = 0          # registrations (flag and runtime), for the metrics
        self.engine: Engine | None = None

    def start(self, ready: engine_pb2.Ready, engine: Engine, served_names: Sequence[str]) -> None:
        """A worker is ready. Raises AdapterError naming the ``--lora-modules``
        adapter that does not fit it (the first Ready only)."""
        modules = [ModuleShape(m.name, m.in_features, m.out_features, m.num_layers) for m in ready.lora_modules]
        self.registry.reserved = tuple(served_names)
        self.engine = engine
        for problem in self.registry.configure(ready.max_loras, ready.max_lora_rank, modules):
            log.warning("%s", problem)
        if self._started:
            return
        self._started = True
        if self._initial and not ready.max_loras:
            raise AdapterError("--lora-modules needs a worker started with --max-loras N (and "
                               "--max-lora-rank R): this worker serves no adapters")
        for name, path, spec in self._initial:
            try:
                self.registry.add(name, path, spec)
            except (AdapterError, ValueError, KeyError) as exc:
                raise AdapterError(f"--lora-modules {name}={path}: {_text(exc)}") from None
            self.num_loads += 1

    def stop(self) -> None:
        """The worker is gone: no scheduler to tell of unloads."""
        self.engine = None

    def load(self, name: str, path: str) -> Adapter:
        """Register an adapter; LoraCallError names the field at fault."""
        if self.engine is None:
            raise LoraCallError("UNAVAILABLE", "lora_name", "the worker is not ready")
        if not name:
            raise LoraCallError("INVALID_ARGUMENT", "lora_name", "is required")
        if not path:
            raise LoraCallError("INVALID_ARGUMENT", "lora_path", "is required")
        try:
            adapter = self.registry.add(name, path)
        except KeyError as exc:
            raise LoraCallError("ALREADY_EXISTS", "lora_name", _text(exc)) from None
        except ValueError as exc:     # AdapterError is a ValueError: the folder's fault
            field = "lora_path" if isinstance(exc, AdapterError) else "lora_name"
            raise LoraCallError("INVALID_ARGUMENT", field, str(exc)) from None
        self.num_loads += 1
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, adapter.path, adapter.spec.rank,
                 ", ".join(adapter.spec.targets))
        return adapter

    def unload(self, name: str) -> Adapter:
        """Unregister ``name``: new requests for it are refused, running ones
        finish; its slot empties with its last sequence."""
        if not name:
            raise LoraCallError("INVALID_ARGUMENT", "lora_name", "is required")
        try:
            adapter = self.registry.remove(name)
        except KeyError:
            raise LoraCallError("NOT_FOUND", "lora_name", f"no adapter named {name!r} is loaded") from None
        if self.engine is not None:
            self.engine.scheduler.lora.retire(adapter.lora_id)
        log.info("LoRA adapter %s unloaded", name)
        return adapter

    def resolve(self, name: str, field: str = "params.lora_adapter") -> Adapter | None:
        """The adapter a request names ("" = the base model); InvalidRequestError if unknown."""
        if not name:
            return None
        adapter = self.registry.get(name)
        if adapter is None:
            known = ", ".join(self.registry.names()) or "none"
            raise InvalidRequestError(field, f"no LoRA adapter named {name!r} is loaded (loaded: {known})")
        return adapter


def read_lora_modules(entries: Sequence[str]) -> list[tuple[str, str, AdapterSpec]]:
    """``--lora-modules NAME=PATH ...`` read (not yet checked against a worker).
    Raises ValueError naming the flag, the entry and the problem."""
    seen: set[str] = set()
    out = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: expected NAME=PATH")
        if (problem := name_problem(name)) is not None:
            raise ValueError(f"--lora-modules {entry!r}: the name {problem}")
        if name in seen:
            raise ValueError(f"--lora-modules {entry!r}: the name {name!r} is given twice")
        seen.add(name)
        try:
            spec = read_adapter(path)
        except AdapterError as exc:
            raise ValueError(f"--lora-modules {entry!r}: {exc}") from None
        out.append((name, path, spec))
    return out


def _text(exc: BaseException) -> str:
    """A KeyError's message without its quotes."""
    return str(exc.args[0]) if exc.args else str(exc)
