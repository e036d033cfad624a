"""A checkpoint's HF-named tensors into a transformers model built on the meta
device (the transformers fallback, ``transformers.py``): names as the model's,
tensors placed as they are, the non-persistent buffers computed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jitney.worker.models.config import UnsupportedModelError


def rename_checkpoint_keys(hf: Any, state: dict[str, torch.Tensor]) -> None:
    """The checkpoint's names as the model's, by transformers' own renamings for its
    architecture (``conversion_mapping.py``: GPT-NeoX's ``embed_out`` is ``lm_head``,
    old names, a missing base-model prefix). A tensor that must be converted (merged,
    split, permuted) rather than renamed is refused: this path places tensors as they are."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = dict.fromkeys(hf.state_dict())
    for key in list(state):
        renamed, converter = rename_source_key(key, renamings, converters, hf.base_model_prefix, names)
        if converter is not None:
            raise UnsupportedModelError(f"{type(hf).__name__}: checkpoint tensor {key} needs transformers' weight "
                                        f"conversion ({converter}), which this path does not run")
        if renamed != key:
            state[renamed] = state.pop(key)


def place_tensors(hf: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """Every parameter and persistent buffer of ``hf`` from ``state`` (floating tensors in
    ``dtype``); a tied one the checkpoint leaves out is tied afterwards."""
    tied = set(getattr(hf, "get_expanded_tied_weights_keys")(all_submodels=True)) \
        if getattr(hf.config, "tie_word_embeddings", False) else set()
    persistent = [(n, b) for n, b in hf.named_buffers(remove_duplicate=False) if _is_persistent(hf, n)]
    missing = []
    for name, current in [*hf.named_parameters(remove_duplicate=False), *persistent]:
        if name not in state:
            if name not in tied:
                missing.append(name)
            continue
        tensor = state.pop(name)
        tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        if tensor.shape != current.shape:
            raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(current.shape)}")
        prefix, _, leaf = name.rpartition(".")
        owner = hf.get_submodule(prefix)
        if isinstance(current, nn.Parameter):
            setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            owner.register_buffer(leaf, tensor)
    if missing:
        raise ValueError(f"checkpoint lacks {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _is_persistent(model: nn.Module, name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return leaf not in model.get_submodule(prefix)._non_persistent_buffers_set


def init_buffers(hf: Any, device: torch.device) -> None:
    """Compute the non-persistent buffers (rotary frequencies, position ids) as transformers'
    own load does: on the device, through the model's ``_init_weights``, which skips every
    tensor the checkpoint filled (their ``_is_hf_initialized``)."""
    from transformers.initialization import guard_torch_init_functions

    for tensor in [*hf.parameters(), *hf.buffers()]:
        tensor._is_hf_initialized = True
    owners = []
    for name, buffer in list(hf.named_buffers(remove_duplicate=False)):
        if _is_persistent(hf, name):
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = hf.get_submodule(prefix)
        owner.register_buffer(leaf, torch.empty_like(buffer, device=device), persistent=False)
        if owner not in owners:
            owners.append(owner)
    with guard_torch_init_functions(), torch.no_grad():
        for owner in owners:
            hf._init_weights(owner)
