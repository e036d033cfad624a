"""Kernel launch choices measured on a card, kept as JSON files by device name.

``bench/gpu_kernels.py`` measures candidate launch shapes of the skinny
linears and of the attention kernel on the card it runs on, and the decode
step with and without the skinny kernels, and writes what won to
``worker/kernels/triton/tuned/<device name>.json`` (as vLLM keeps tuned kernel configs per
device). The worker applies the file of its card before it builds the
model's kernels; a card without a file runs the built-in guesses.

    {"device": "NVIDIA H200",
     "skinny": {"960x576": [block_n, block_k, warps, stages, max_rows], ...},   # N x K: where it beat cuBLAS
     "skinny_rows": 16,                                                        # the default of --skinny-rows
     "attention": {"32/8": {"prefill_rows": 128, "block_n": 64,                # by query / kv heads; "*": others
                            "prefill": [warps, stages], "decode": [warps, stages]}}}   # null: Triton's default

``$JITNEY_TUNED_CONFIGS`` names another folder to read (the sweep's own
output, before it is committed).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("jitney.worker")

FOLDER = Path(__file__).resolve().parent.parent / "kernels" / "triton" / "tuned"


def file_name(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3.json"``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_") + ".json"


def find(device_name: str) -> Path | None:
    """The tuned file of ``device_name``: in ``$JITNEY_TUNED_CONFIGS`` first, then the shipped folder."""
    folders = [Path(os.environ["JITNEY_TUNED_CONFIGS"])] if os.environ.get("JITNEY_TUNED_CONFIGS") else []
    for folder in [*folders, FOLDER]:
        path = folder / file_name(device_name)
        if path.is_file():
            return path
    return None


def apply(device: torch.device, heads: tuple[int, int]) -> int | None:
    """Apply the tuned launch choices of ``device``'s card (CUDA only) for a model of ``heads``
    (query heads, kv heads) -> the file's ``skinny_rows``, or None without one.

    A file that does not parse is reported and ignored: the built-in choices run.
    """
    if device.type != "cuda":
        return None
    path = find(torch.cuda.get_device_name(device))
    if path is None:
        return None
    try:
        rows = apply_data(json.loads(path.read_text()), heads)
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("ignoring the tuned kernel configs %s: %s", path, err)
        return None
    logger.info("tuned kernel configs: %s", path.name)
    return rows


def apply_data(data: dict[str, Any], heads: tuple[int, int]) -> int | None:
    """Set the kernels' launch tables from a tuned file's contents -> its ``skinny_rows``."""
    from jitney.worker.attention import triton as triton_attention
    from jitney.worker.kernels.triton import skinny as triton_skinny

    skinny = {}
    for key, value in data.get("skinny", {}).items():
        n, k = (int(v) for v in key.split("x"))
        skinny[(n, k)] = triton_skinny.SkinnyConfig(*(int(v) for v in value))
    by_heads = data.get("attention", {})
    attention = by_heads.get(f"{heads[0]}/{heads[1]}", by_heads.get("*", {}))
    launch = {kind: tuple(None if v is None else int(v) for v in attention[kind])
              for kind in ("prefill", "decode") if kind in attention}
    rows = data.get("skinny_rows")
    if rows is not None and not 0 <= int(rows) <= triton_skinny.MAX_ROWS:
        raise ValueError(f"skinny_rows {rows} out of [0, {triton_skinny.MAX_ROWS}]")
    # Only once everything parsed:
    triton_skinny.CONFIGS.update(skinny)
    triton_attention.LAUNCH.update(launch)  # type: ignore[arg-type]
    if "prefill_rows" in attention:
        triton_attention.PREFILL_ROWS = int(attention["prefill_rows"])
    if "block_n" in attention:
        triton_attention.BLOCK_N = int(attention["block_n"])
    return None if rows is None else int(rows)
