"""transformers' own reading of the default GGUF model, the reference several tests compare with.

transformers reads a GGUF through gguf's Python field reader, twice (config,
then tensors): 20-40 s of CPU for the bundled model. The first test of a run
to ask pays it and saves the module transformers built (``torch.save``: its
GGUF-quantized model refuses ``save_pretrained``); every later one, on either
xdist worker, loads that file, the same module and tensors, in about 2 s. The
file lives in the run's shared temporary root, so each run reads the GGUF
afresh.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
import torch


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is a folder of the run's one root.
    return base.parent if base.name.startswith("popen-gw") else base


def default_model_reference(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """The default model as transformers loads it from the GGUF, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    from jitney.common.model_files import resolve_model

    folder = _shared_root(tmp_path_factory) / "default-model-reference"
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)   # released at close, or when a killed worker dies
        saved = folder / "model.pt"
        if not saved.exists():
            files = resolve_model(None)
            model = AutoModelForCausalLM.from_pretrained(str(files.directory), dtype=torch.float32,
                                                         **files.pretrained_kwargs())
            torch.save(model, folder / "partial.pt")
            (folder / "partial.pt").rename(saved)   # whole or absent, if this worker is killed
            return model.eval()
    module: torch.nn.Module = torch.load(saved, weights_only=False)   # written by this run, above
    return module.eval()
