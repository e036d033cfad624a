"""LoRA adapters on the scheduler side: the registry of served adapters and
the residency of the worker's adapter slots. Policy and bookkeeping only.

Registry (``AdapterRegistry``): served name -> ``Adapter`` (folder, spec, a
registration id unique in the process). A request carries its adapter's id,
which also seeds its prefix-cache keys (block_manager.py): a hit never
crosses adapters, nor a name registered again with other weights.

Residency (``LoraSlots``): the worker has ``max_loras`` slots (Ready); a
sequence runs with the adapter of one slot, which the scheduler loads by a
``LoraLoad`` in a plan (applied after the plan's frees, before its new
sequences). A slot's holders are the sequences boarded on it and not yet
freed; a slot with holders is never loaded again.

    slot state              boarding a request of adapter X
    holds X                 uses it (no load)
    empty / unheld LRU      X is loaded into it in this step's plan
    all held by others      the request waits; one held slot is marked
                            draining (nobody new boards on it) so it empties
                            as its sequences end: no starvation, and requests
                            of resident adapters and the base still board

A preempted sequence is freed by the worker, so it releases its hold; it
boards again like a new one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from jitney.common.lora_adapter import AdapterError, AdapterSpec, ModuleShape, check_adapter, read_adapter



@dataclass(frozen=True)
class Adapter:
    """A served adapter: its name, folder, spec and registration id (>= 1)."""
    name: str
    path: str
    spec: AdapterSpec
    lora_id: int


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter, or None: the rule of the served
    model's names (scheduler/main.py's --served-model-name)."""
    if not name or len(name) > 256 or not name.isprintable() or name != name.strip():
        return f"must be 1-256 printable characters without leading or trailing spaces, got {name[:64]!r}"
    return None


@dataclass
class AdapterRegistry:
    """The adapters a server answers to (--lora-modules, then the runtime
    load/unload calls). ``modules`` and ``max_rank`` are the worker's
    (Ready); ``max_loras`` 0 means the worker runs without LoRA."""

    reserved: tuple[str, ...] = ()          # the base model's served names
    max_loras: int = 0
    max_rank: int = 0
    modules: list[ModuleShape] = field(default_factory=list)
    _adapters: dict[str, Adapter] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def configure(self, max_loras: int, max_rank: int, modules: list[ModuleShape]) -> list[str]:
        """A (new) worker's LoRA facts: the registered adapters are checked
        again; those that no longer fit are dropped. Returns the problems."""
        self.max_loras, self.max_rank, self.modules = max_loras, max_rank, list(modules)
        problems = []
        for adapter in list(self._adapters.values()):
            try:
                self._check(adapter.spec)
            except AdapterError as exc:
                del self._adapters[adapter.name]
                problems.append(f"adapter {adapter.name} dropped: {exc}")
        return problems

    def _check(self, spec: AdapterSpec) -> None:
        if self.max_loras == 0:
            raise AdapterError("the worker serves no LoRA adapters: start it with --max-loras N "
                               "(and --max-lora-rank R)")
        check_adapter(spec, self.modules, self.max_rank)

    def add(self, name: str, path: str, spec: AdapterSpec | None = None) -> Adapter:
        """Register ``name``; ``spec`` when already read. Raises ValueError
        for a bad or taken name, AdapterError for a bad adapter (the registry
        unchanged either way)."""
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        if name in self.reserved:
            raise ValueError(f"{name!r} is the served model's name")
        if name in self._adapters:
            raise KeyError(f"an adapter named {name!r} is already loaded")
        spec = spec or read_adapter(path)
        self._check(spec)
        adapter = Adapter(name, str(Path(path)), spec, next(self._ids))
        self._adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> Adapter:
        """Unregister ``name`` (KeyError if unknown); requests already taken keep it."""
        return self._adapters.pop(name)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return list(self._adapters)

    def adapters(self) -> list[Adapter]:
        return list(self._adapters.values())


@dataclass
class _Slot:
    lora_id: int = 0          # 0: empty
    name: str = ""
    holders: int = 0
    last_used: int = 0        # a tick: the LRU order among unheld slots
    retired: bool = False     # unloaded: emptied once its last holder leaves


@dataclass(frozen=True)
class LoraLoadOrder:
    """A slot to load in this step's plan (engine StepPlan.lora_loads)."""
    slot: int
    name: str
    path: str


class LoraSlots:
    """The worker's adapter slots 1..max_loras, as the scheduler fills them."""

    def __init__(self, max_loras: int) -> None:
        self._slots = [_Slot() for _ in range(max_loras)]
        self._tick = itertools.count(1)
        self._draining: int | None = None     # a slot index nobody new boards on
        self.num_loads = 0

    @property
    def max_loras(self) -> int:
        return len(self._slots)

    def _find(self, lora_id: int) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s.lora_id == lora_id), None)

    def can_board(self, lora_id: int, loads: list[LoraLoadOrder]) -> bool:
        """Whether a request of adapter ``lora_id`` (0: base) can board now;
        if not, it waits and a held slot starts draining for it."""
        if lora_id == 0:
            return True
        at = self._find(lora_id)
        if at is not None:
            if at == self._draining and self._slots[at].holders == 0:
                self._draining = None   # drained and nobody took it: its own adapter may stay
            return at != self._draining
        if self._free_slot(loads) is not None:
            return True
        if self._draining is None:
            # The slot whose sequences end soonest, as far as one can tell: the fewest holders.
            self._draining = min(range(len(self._slots)), key=lambda i: (self._slots[i].holders, i))
        return False

    def _free_slot(self, loads: list[LoraLoadOrder]) -> int | None:
        """An empty slot, else the least recently used one without holders
        (not loaded earlier in this step)."""
        loaded = {order.slot - 1 for order in loads}
        free = [i for i, s in enumerate(self._slots) if s.holders == 0 and i not in loaded]
        if not free:
            return None
        return min(free, key=lambda i: (self._slots[i].lora_id != 0, self._slots[i].last_used, i))

    def board(self, lora_id: int, name: str, path: str, loads: list[LoraLoadOrder]) -> int:
        """Hold a slot of ``lora_id`` for a boarding sequence (``can_board``
        said yes); a load joins ``loads`` where it was not resident. The slot (1..)."""
        if lora_id == 0:
            return 0
        at = self._find(lora_id)
        if at is None:
            at = self._free_slot(loads)
            assert at is not None, "board() without can_board()"
            self._slots[at] = _Slot(lora_id=lora_id, name=name)
            loads.append(LoraLoadOrder(at + 1, name, path))
            self.num_loads += 1
            if self._draining == at:
                self._draining = None
        slot = self._slots[at]
        slot.holders += 1
        slot.last_used = next(self._tick)
        return at + 1

    def release(self, slot_number: int) -> None:
        """A sequence of slot ``slot_number`` left the worker (freed in the next plan)."""
        if slot_number == 0:
            return
        slot = self._slots[slot_number - 1]
        assert slot.holders > 0, f"slot {slot_number} released more often than held"
        slot.holders -= 1
        slot.last_used = next(self._tick)
        if slot.holders == 0 and slot.retired:
            self._slots[slot_number - 1] = _Slot(last_used=slot.last_used)

    def retire(self, lora_id: int) -> None:
        """``lora_id`` was unloaded: its slot empties when its last holder
        leaves (at once if it has none)."""
        at = self._find(lora_id)
        if at is None:
            return
        if self._slots[at].holders == 0:
            self._slots[at] = _Slot(last_used=self._slots[at].last_used)
        else:
            self._slots[at].retired = True

    def forget_loaded(self) -> None:
        """The worker's slots are unknown (a failed step; its later plans,
        loads included, were discarded): every slot counts as empty. Called
        once every sequence has been released."""
        assert all(s.holders == 0 for s in self._slots), "forget_loaded with held slots"
        self._slots = [_Slot() for _ in self._slots]
        self._draining = None

    def resident(self) -> list[tuple[int, str, int]]:
        """(slot, adapter name, holders) of each loaded slot."""
        return [(i + 1, s.name, s.holders) for i, s in enumerate(self._slots) if s.lora_id]

    def check_invariants(self, holders: dict[int, int]) -> None:
        """``holders``: slot -> sequences the scheduler has boarded on it."""
        for i, s in enumerate(self._slots):
            if s.holders != holders.get(i + 1, 0):
                raise AssertionError(f"slot {i + 1} counts {s.holders} holders, {holders.get(i + 1, 0)} ride it")
            if s.holders and not s.lora_id:
                raise AssertionError(f"empty slot {i + 1} has holders")
