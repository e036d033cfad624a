"""Which model file runs a checkpoint: Hugging Face architecture names (``config.json``'s
``architectures``), or its ``model_type`` where a config names no architecture (a GGUF
file's), to a family module.

A family module (``llama.py`` is the first) defines ``ARCHITECTURES``, ``MODEL_TYPES``,
``config_from_hf(hf) -> ModelConfig`` (whose ``family`` is the module's name) and
``CausalLM``, which the loader builds. A new family is one file here and
one entry in ``FAMILIES``.

A ``*ForCausalLM`` architecture no native family runs goes to the
transformers fallback (``transformers.py``: transformers' own modeling code
over Jitney's paged attention), unless that refuses it too.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jitney.worker.models import gemma, gpt_oss, llama, mixtral, phi3, qwen3, qwen3_moe
from jitney.worker.models import transformers as transformers_family
from jitney.worker.models.config import UnsupportedModelError

# The native families: their own model code, a layer program each (layers/program.py).
FAMILIES: tuple[ModuleType, ...] = (llama, qwen3, phi3, mixtral, qwen3_moe, gemma, gpt_oss)

# What the loader builds and the runner drives: a family's ``CausalLM``.
ServedModel = llama.CausalLM | transformers_family.CausalLM

_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.ARCHITECTURES}
_BY_MODEL_TYPE = {kind: family for family in FAMILIES for kind in family.MODEL_TYPES}
_BY_NAME = {family.__name__.rsplit(".", 1)[-1]: family for family in (*FAMILIES, transformers_family)}


def family_named(name: str) -> ModuleType:
    """The family module a ``ModelConfig.family`` names."""
    if name not in _BY_NAME:
        raise UnsupportedModelError(f"no model family {name!r} (known: {', '.join(sorted(_BY_NAME))})")
    return _BY_NAME[name]


def family_for(hf: Any) -> ModuleType:
    """The family module that runs transformers config ``hf``: a native one, else the
    transformers fallback; raises ``UnsupportedModelError`` naming the architecture,
    what it lacks, and what runs natively."""
    architectures = list(getattr(hf, "architectures", None) or [])
    for arch in architectures:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    model_type = getattr(hf, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    problem = transformers_family.refusal(hf)
    if problem is None:
        return transformers_family
    named = f"architecture {', '.join(architectures)} (model_type {model_type!r})" if architectures \
        else f"model_type {model_type!r}"
    raise UnsupportedModelError(f"{named} is not supported: {problem} (native: {', '.join(sorted(_BY_ARCHITECTURE))}; "
                                "through transformers: other *ForCausalLM decoders)")
