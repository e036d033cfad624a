"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama family's layer, from checkpoints that
ship q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``: Jitney's own
parameter names, loaded whole or, under tensor parallelism, cut into their parts
before each rank takes its rows, ``layers/linear.py``), with LongRoPE scaling for
the long-context variants (``layers/rotary.py``)."""

from __future__ import annotations

from typing import Any

from jitney.worker.models import llama
from jitney.worker.models.config import ModelConfig

ARCHITECTURES = ("Phi3ForCausalLM",)
MODEL_TYPES = ("phi3",)


def config_from_hf(hf: Any) -> ModelConfig:
    return llama.config_from_hf(hf, family="phi3")


class CausalLM(llama.CausalLM):
    pass
