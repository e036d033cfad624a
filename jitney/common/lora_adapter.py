"""A LoRA adapter as PEFT saves it, read without torch: its config and its
tensors' names and shapes (the safetensors header), checked against the
modules a served model offers (the worker's ``Ready.lora_modules``).

The scheduler checks an adapter with this before it ever reaches a plan, so a
bad one is refused at registration with a message naming what is wrong and
the server is unchanged; the worker reads the same names with it when it
loads the tensors into a slot.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors``,
whose tensors are named ``base_model.model.model.layers.{i}.{block}.{module}
.lora_{A,B}.weight``: A is ``[r, in_features]``, B ``[out_features, r]``, and
the module's output gains ``scaling * B @ A @ x`` with ``scaling`` =
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).
``rank_pattern`` and ``alpha_pattern`` override r and alpha per module, as
PEFT matches them (a key matches a module whose dotted name ends with it).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A header larger than this is not an adapter's (100 MiB of JSON).
_MAX_HEADER = 100 << 20
_KEY = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.([A-Za-z0-9_]+)"
    r"\.lora_(A|B)(?:\.default)?\.weight")
_DTYPES = {"F32", "F16", "BF16"}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True)
class ModuleShape:
    """A linear an adapter may target (``Ready.lora_modules``)."""
    name: str
    in_features: int
    out_features: int
    num_layers: int


@dataclass(frozen=True)
class LoraTensor:
    """One module of one layer: its A and B tensors' names, rank and scaling."""
    layer: int
    module: str
    a_key: str
    b_key: str
    rank: int
    scaling: float


@dataclass
class AdapterSpec:
    path: Path
    rank: int                       # the largest of its modules' ranks
    targets: tuple[str, ...]        # module names it adapts, sorted
    tensors: list[LoraTensor] = field(default_factory=list)
    base_model: str = ""            # base_model_name_or_path, as written (informational)

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def _pattern_value(patterns: dict, layer: int, module: str, default: float) -> float:
    """PEFT's rank/alpha pattern lookup: the first key the module's dotted
    name ends with (keys are regular expressions)."""
    dotted = f"model.layers.{layer}.{module}"
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", dotted) or re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def read_header(path: Path) -> dict[str, dict]:
    """The safetensors header of ``path``: tensor name -> {dtype, shape, ...}."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise AdapterError(f"{path}: not a safetensors file (shorter than its header length)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise AdapterError(f"{path}: not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except OSError as e:
        raise AdapterError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    return header


def read_adapter(path: str | Path) -> AdapterSpec:
    """Read and check a PEFT LoRA folder on its own (no model yet). Raises
    AdapterError naming the file and what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"{folder}: not a folder (a PEFT adapter is a folder with {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE})")
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{config_path}: peft_type {peft_type!r}; only LORA adapters are served")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights"),
                       ("lora_bias", "lora_bias"), ("use_qalora", "QALoRA"), ("use_bdlora", "BD-LoRA"),
                       ("alora_invocation_tokens", "aLoRA (activated LoRA)"),
                       ("target_parameters", "target_parameters (expert parameters)"),
                       ("trainable_token_indices", "trainable_token_indices")):
        if config.get(flag):
            raise AdapterError(f"{config_path}: {what} is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{config_path}: bias {config.get('bias')!r}; only bias \"none\" is supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{config_path}: modules_to_save {config['modules_to_save']!r}: an adapter "
                           "that replaces whole modules is not supported")
    if config.get("layer_replication"):
        raise AdapterError(f"{config_path}: layer_replication is not supported")
    try:
        r_default = int(config.get("r", 8))
        alpha_default = float(config.get("lora_alpha", 8))
    except (TypeError, ValueError):
        raise AdapterError(f"{config_path}: r and lora_alpha must be numbers") from None
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise AdapterError(f"{config_path}: rank_pattern and alpha_pattern must be objects")
    rslora = bool(config.get("use_rslora", False))

    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = " (adapter_model.bin, a pickle, is not loaded: convert it to safetensors)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE}{other}")
    header = read_header(weights)

    halves: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    for key, info in header.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"{weights}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                               "layer's attention or MLP module")
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            raise AdapterError(f"{weights}: tensor {key!r} has dtype {info.get('dtype') if isinstance(info, dict) else info!r}; "
                               f"expected one of {sorted(_DTYPES)}")
        shape = info.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
            raise AdapterError(f"{weights}: tensor {key!r} has shape {shape!r}; expected a matrix")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = (key, shape)
    if not halves:
        raise AdapterError(f"{weights}: no LoRA tensors")

    tensors: list[LoraTensor] = []
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise AdapterError(f"{weights}: layer {layer} {module} has no lora_{missing} tensor")
        (a_key, a_shape), (b_key, b_shape) = pair["A"], pair["B"]
        rank = a_shape[0]
        if b_shape[1] != rank:
            raise AdapterError(f"{weights}: layer {layer} {module}: lora_A has rank {rank} but lora_B "
                               f"{b_shape[1]} (shapes {a_shape} and {b_shape})")
        expected_rank = int(_pattern_value(rank_pattern, layer, module, r_default))
        if rank != expected_rank:
            raise AdapterError(f"{weights}: layer {layer} {module} has rank {rank}, its config says "
                               f"{expected_rank}")
        alpha = _pattern_value(alpha_pattern, layer, module, alpha_default)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        tensors.append(LoraTensor(layer, module, a_key, b_key, rank, scaling))
    return AdapterSpec(path=folder, rank=max(t.rank for t in tensors),
                       targets=tuple(sorted({t.module for t in tensors})), tensors=tensors,
                       base_model=str(config.get("base_model_name_or_path") or ""))


def check_adapter(spec: AdapterSpec, modules: list[ModuleShape], max_rank: int) -> None:
    """Check ``spec`` against the served model's modules and the rank bound.
    Raises AdapterError naming the first mismatch."""
    by_name = {m.name: m for m in modules}
    if spec.rank > max_rank:
        raise AdapterError(f"{spec.path}: rank {spec.rank} is above --max-lora-rank {max_rank}")
    header = read_header(spec.weights_file)
    for t in spec.tensors:
        module = by_name.get(t.module)
        if module is None:
            raise AdapterError(f"{spec.path}: targets {t.module!r}, which this model does not offer "
                               f"(it offers {', '.join(sorted(by_name)) or 'none'})")
        if t.layer >= module.num_layers:
            raise AdapterError(f"{spec.path}: layer {t.layer} {t.module}: the model has "
                               f"{module.num_layers} layers")
        a_shape, b_shape = header[t.a_key]["shape"], header[t.b_key]["shape"]
        if a_shape[1] != module.in_features or b_shape[0] != module.out_features:
            raise AdapterError(
                f"{spec.path}: layer {t.layer} {t.module} maps {a_shape[1]} -> {b_shape[0]} features, "
                f"the model's {module.in_features} -> {module.out_features} (an adapter of another base model?)")
