"""PEFT-shaped LoRA folders written without torch (numpy safetensors), for the
scheduler's tests, and a scripted worker's Ready that serves adapters."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jitney.engine.v1 import engine_pb2
from tests.support.scripted_worker import READY

HIDDEN, LAYERS, MAX_RANK = 64, 2, 8
MODULES = {"q_proj": (HIDDEN, HIDDEN), "v_proj": (HIDDEN, 32)}   # name -> (in, out)


def lora_ready(max_loras: int = 2) -> engine_pb2.Ready:
    """The scripted worker's Ready with ``max_loras`` adapter slots."""
    ready = engine_pb2.Ready()
    ready.CopyFrom(READY)
    ready.max_loras, ready.max_lora_rank = max_loras, MAX_RANK
    ready.lora_modules.extend(engine_pb2.LoraModule(name=n, in_features=i, out_features=o, num_layers=LAYERS)
                              for n, (i, o) in MODULES.items())
    return ready


def write_adapter(path: Path, *, rank: int = 4, modules: Sequence[str] = ("q_proj", "v_proj"),
                  layers: Sequence[int] = range(LAYERS), shapes: dict[str, tuple[int, int]] | None = None,
                  **config: Any) -> Path:
    """A LoRA folder as PEFT saves it; ``shapes`` overrides a module's (in, out);
    ``config`` overrides adapter_config.json's fields."""
    shapes = {**MODULES, **(shapes or {})}
    tensors = {}
    for layer in layers:
        for module in modules:
            n_in, n_out = shapes.get(module, (HIDDEN, HIDDEN))
            block = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = np.full((rank, n_in), 0.01, dtype=np.float32)
            tensors[f"{key}.lora_B.weight"] = np.full((n_out, rank), 0.01, dtype=np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
                "bias": "none", "base_model_name_or_path": "tiny-scripted", **config}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path
