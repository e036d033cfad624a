"""References the sampling tests share (tests/worker/test_sampling_params*.py):
the tiny model's vocabulary and EOS, transformers' repetition penalty with
frequency and presence by hand, and grammar bitmasks of allowed ids."""

from __future__ import annotations

import numpy as np
import torch
from transformers import RepetitionPenaltyLogitsProcessor

VOCAB = 320          # the tiny model's
EOS = 2


def ref_penalties(logits: torch.Tensor, prompt: list[list[int]], output: list[list[int]],
                  rep: list[float], presence: list[float], frequency: list[float]) -> torch.Tensor:
    """transformers' repetition penalty over prompt + output, then frequency and presence by hand."""
    out = logits.clone()
    for i in range(len(out)):
        seen = torch.tensor([prompt[i] + output[i]])
        out[i:i + 1] = RepetitionPenaltyLogitsProcessor(rep[i])(seen, out[i:i + 1])
        counts = torch.bincount(torch.tensor(output[i], dtype=torch.int64), minlength=out.shape[1]).float()
        out[i] = out[i] - frequency[i] * counts
        out[i] = out[i] - presence[i] * (counts > 0).float()
    return out


def bitmask(allowed_ids: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    words = np.zeros((len(allowed_ids), -(-vocab // 32)), dtype=np.int64)
    for row, ids in enumerate(allowed_ids):
        for t in ids:
            words[row, t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)
