"""Converted weights kept on disk, so that a restarted worker loads in seconds.

Loading the bundled GGUF model takes ~10 s on a 2-core CPU before a single
weight is placed: transformers' GGUF reader parses the whole file (its
49,152-entry vocabulary, field by field) once for the config and again for
the tensors, then de-quantises them, and importing transformers alone takes
seconds. None of that changes between two starts of the same file, so the
first load writes what it produced to an entry of this cache and later loads
read the entry instead:

    <root>/<key>/meta.json          ModelConfig + the model's facts (uncapped)
    <root>/<key>/model.safetensors  the HF-named tensors, de-quantised to the
                                    dtype (GGUF models only: a safetensors
                                    folder is already read as fast as a copy)

``key`` hashes what the entry was made from: the model's path, the size and
modification time of each file read, the dtype, the transformers version
(its GGUF reader does the de-quantisation), this cache's format and the
source of the loader's conversion code. A change to any of them misses and
writes a new entry; nothing is trusted that might be stale. An entry is
written into a private temporary folder and renamed into place, so a reader
never sees half of one and two workers writing at once leave one whole
entry. An entry that cannot be read is removed and the model is loaded from
its source (logged). The newest ``KEEP_ENTRIES`` entries that hold converted
tensors are kept, and, counted apart, the newest ``KEEP_META_ENTRIES`` that
hold only a config (a few KB each): small models' entries must not evict the
one whose conversion costs seconds.

The root is ``--weights-cache DIR``, else ``$JITNEY_WEIGHTS_CACHE``, else
``~/.cache/jitney/weights``; ``--no-weights-cache`` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jitney.common.model_files import ModelFiles, keep_newest, publish_entry
from jitney.worker.layers.rotary import RopeScaling
from jitney.worker.models.config import ModelConfig, ModelFacts

logger = logging.getLogger("jitney.worker")

CACHE_FORMAT = 1
KEEP_ENTRIES = 4          # with tensors: a model's size of disk each
KEEP_META_ENTRIES = 64    # config and facts only
META_FILE = "meta.json"
WEIGHTS_FILE = "model.safetensors"
# The code that turns a model's files into an entry: an edit to it misses.
CODE_FILES = (Path(__file__).parent / "loader.py", Path(__file__))


@dataclass(frozen=True)
class CachedModel:
    config: ModelConfig
    facts: ModelFacts                       # before --max-model-len caps the context
    weights: Path | None                    # the converted tensors; None: read the source's safetensors


def source_files(files: ModelFiles) -> list[Path]:
    """Every file a load reads (whose change must miss the cache)."""
    if files.gguf_file is not None:
        return [files.directory / files.gguf_file]
    names = ["config.json", "generation_config.json"]
    found = [files.directory / n for n in names if (files.directory / n).is_file()]
    return found + sorted(files.directory.glob("*.safetensors"))


def entry_key(files: ModelFiles, dtype: torch.dtype) -> str:
    described = {
        "format": CACHE_FORMAT,
        "model": str(files.directory.resolve() / (files.gguf_file or "")),
        "files": [[p.name, st.st_size, st.st_mtime_ns] for p in source_files(files) for st in [p.stat()]],
        "dtype": str(dtype),
        "transformers": _version("transformers"),
        "code": [hashlib.sha256(path.read_bytes()).hexdigest() for path in CODE_FILES],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


class WeightsCache:
    """One cache root; ``None`` entries mean the load goes to the source."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self, files: ModelFiles, dtype: torch.dtype) -> CachedModel | None:
        """The entry of these files and dtype, or None. Its tensors are read by the
        load, each rank its own parts (``loading/checkpoint.py``); here only their header."""
        folder = self.root / entry_key(files, dtype)
        if not (folder / META_FILE).is_file():
            return None
        try:
            meta = json.loads((folder / META_FILE).read_text())
            config = _config_from_json(meta["config"])
            facts = ModelFacts(meta["facts"]["name"], int(meta["facts"]["vocab_size"]),
                          int(meta["facts"]["context_length"]),
                          tuple(int(t) for t in meta["facts"]["eos_token_ids"]))
            weights = None
            if meta["has_weights"]:
                from safetensors import safe_open

                weights = folder / WEIGHTS_FILE
                with safe_open(str(weights), framework="pt", device="cpu") as f:   # a damaged header raises
                    f.keys()
        except Exception as err:   # a damaged entry: drop it, load from the source
            logger.warning("weights cache entry %s is unreadable (%s: %s); removing it and loading "
                           "from the source", folder, type(err).__name__, err)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        os.utime(folder)   # most recently used
        return CachedModel(config, facts, weights)

    def write(self, files: ModelFiles, dtype: torch.dtype, config: ModelConfig, facts: ModelFacts,
              state: dict[str, torch.Tensor] | None) -> Path | None:
        """Write an entry (``state`` None: meta only); None if it could not be written (logged)."""
        folder = self.root / entry_key(files, dtype)

        def fill(tmp: Path) -> None:
            if state is not None:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_FILE))
            meta = {"format": CACHE_FORMAT, "source": str(files.directory / (files.gguf_file or "")),
                    "dtype": str(dtype), "has_weights": state is not None,
                    "config": _config_to_json(config), "facts": dataclasses.asdict(facts)}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))

        try:
            publish_entry(folder, fill)
        except OSError as err:
            logger.warning("could not write the weights cache at %s (%s); later starts will "
                           "convert the model again", self.root, err)
            return None
        with_tensors: list[Path] = []
        config_only: list[Path] = []
        for entry in self.root.iterdir():
            if entry.is_dir() and (entry / META_FILE).is_file():
                (with_tensors if (entry / WEIGHTS_FILE).is_file() else config_only).append(entry)
        keep_newest(with_tensors, KEEP_ENTRIES)
        keep_newest(config_only, KEEP_META_ENTRIES)
        return folder


def _config_to_json(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _tuples(data: dict[str, Any]) -> dict[str, Any]:
    """JSON's lists back to the frozen dataclasses' tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def _config_from_json(data: dict[str, Any]) -> ModelConfig:
    rope = data.pop("rope_scaling", None)
    return ModelConfig(**_tuples(data), rope_scaling=RopeScaling(**_tuples(rope)) if rope is not None else None)
