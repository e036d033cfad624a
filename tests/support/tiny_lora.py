"""Random LoRA adapters saved by PEFT itself, for a tiny base model folder.

PEFT initialises B to zero (an adapter that changes nothing); these fill A
and B with seeded random values large enough to move the logits, then save
with PEFT's own ``save_pretrained``, so the folder is exactly what users
bring (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base: Path, path: Path, *, rank: int = 8, alpha: float = 16.0,
                      targets: Sequence[str] = ATTENTION + MLP, seed: int = 0, scale: float = 0.2,
                      use_rslora: bool = False, rank_pattern: dict[str, int] | None = None,
                      alpha_pattern: dict[str, float] | None = None,
                      layers: Sequence[int] | None = None) -> Path:
    """A seeded random LoRA adapter of ``base`` (an HF folder), saved to ``path``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    # (PEFT annotates lora_alpha as int; it only divides by it, and its alpha_pattern takes floats)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,  # type: ignore[arg-type]
                        bias="none", task_type="CAUSAL_LM", use_rslora=use_rslora,
                        rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                        layers_to_transform=list(layers) if layers is not None else None)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    path.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(path), safe_serialization=True)
    return path


def peft_reference(base: Path, adapter: Path) -> Any:
    """transformers' model of ``base`` with ``adapter`` applied by PEFT (fp32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).eval()
