"""The runner's side of LoRA: the model's adapter slots (``--max-loras``), a plan's
``lora_loads`` and ``NewSequence.lora_slot`` checked and applied, each step's
per-token slot index, and what ``Ready`` reports.

A plan's loads are applied before its other diffs: the scheduler never loads into
a slot a held sequence uses, so that is the same as after ``freed_seq_ids``, and a
failed load (its slot left empty, ``layers/lora.py``) leaves every sequence as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from jitney.engine.v1 import engine_pb2
from jitney.worker.config import WorkerConfig
from jitney.worker.layers.lora import LoraSlots
from jitney.worker.runner.input_batch import StepChunk
from jitney.worker.runner.plan_checks import PlanError


def use_lora(model: Any, config: WorkerConfig, implementation: str, dtype: torch.dtype,
             device: torch.device) -> LoraSlots | None:
    """The model's adapter slots, or None when LoRA is off; raises ``ValueError`` for a model
    that cannot take adapters."""
    if not config.max_loras:
        return None
    if implementation != "native" or not hasattr(model, "use_lora"):
        raise ValueError(f"--max-loras: the {implementation} model implementation (family "
                         f"{model.config.family!r}: the transformers fallback) cannot serve LoRA adapters; only "
                         "Jitney's own families can (start without --max-loras)")
    slots: LoraSlots = model.use_lora(config.max_loras, config.max_lora_rank, dtype, device)
    return slots


def check_plan(plan: engine_pb2.StepPlan, lora: LoraSlots | None) -> None:
    """Refuse (``PlanError``, nothing applied) adapter slots this worker does not have."""
    limit = lora.max_loras if lora is not None else 0
    for load in plan.lora_loads:
        if not 1 <= load.slot <= limit:
            raise PlanError(f"step {plan.step_id}: lora_loads slot {load.slot} of adapter {load.name!r} "
                            f"is not in 1..max_loras = {limit}")
    for new in plan.new_sequences:
        if new.lora_slot > limit:
            raise PlanError(f"step {plan.step_id}: seq {new.seq_id} has lora_slot {new.lora_slot}, "
                            f"above max_loras = {limit}")


def apply_loads(plan: engine_pb2.StepPlan, lora: LoraSlots | None) -> None:
    """The plan's loads, in order (``check_plan`` ran: a plan with loads has slots)."""
    for load in plan.lora_loads:
        assert lora is not None
        lora.load(load.slot, load.name, load.path)


def token_slots(chunks: list[StepChunk], slot_of: dict[int, int], device: torch.device) -> torch.Tensor | None:
    """Each staged token's slot (T,) int32 on ``device``, in the chunks' (staging) order;
    None when no chunk has an adapter: a base-only step costs nothing extra."""
    if not slot_of or not any(c.seq_id in slot_of for c in chunks):
        return None
    slots = np.concatenate([np.full(len(c.tokens), slot_of.get(c.seq_id, 0), dtype=np.int32) for c in chunks])
    return torch.from_numpy(slots).to(device)


def ready_fields(lora: LoraSlots | None) -> dict[str, Any]:
    """``Ready``'s max_loras, max_lora_rank and lora_modules (zeros and none when LoRA is off)."""
    if lora is None:
        return {"max_loras": 0, "max_lora_rank": 0, "lora_modules": []}
    return {"max_loras": lora.max_loras, "max_lora_rank": lora.max_rank,
            "lora_modules": [engine_pb2.LoraModule(name=m.name, in_features=m.in_features,
                                                   out_features=m.out_features, num_layers=m.num_layers)
                             for m in lora.modules()]}
