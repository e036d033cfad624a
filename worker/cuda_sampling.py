"""Sampling without host syncs, for the CUDA path.

``worker.sampler.sample`` finds its greedy / plain / filtered rows with
``nonzero()``, which waits for the GPU. Here the rows are sorted into those
groups from the host copy of each sequence's parameters, and filtered rows
always take the full sort (the sampler's answer never depends on its
candidate count), so the step's only sync is the one copy of the results.
Tokens are identical to ``sample``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.plan import SequenceState
from worker.sampler import SamplingBatch, _gumbel, _race, nucleus


def _rows(states: Sequence[SequenceState], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the plain random rows and of the top-k/top-p rows."""
    plain = [i for i, s in enumerate(states) if s.temperature > 0 and s.top_k == 0 and s.top_p >= 1.0]
    filtered = [i for i, s in enumerate(states) if s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0)]
    return (
        torch.tensor(plain, dtype=torch.int64, device=device),
        torch.tensor(filtered, dtype=torch.int64, device=device),
    )


def sample_without_sync(
    logits: torch.Tensor, params: SamplingBatch, states: Sequence[SequenceState]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``worker.sampler.sample``; ``states`` are the rows' host parameters."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    plain, filtered = _rows(states, logits.device)
    if plain.numel() > 0:
        rows = params.rows(plain)
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        noisy = _gumbel(rows, vocab).add_(logits[plain] / rows.temperature[:, None])
        tokens[plain] = noisy.argmax(dim=-1)
    if filtered.numel() > 0:
        rows = params.rows(filtered)
        scaled = logits[filtered] / rows.temperature[:, None]
        ordered, ids = scaled.sort(dim=-1, descending=True, stable=True)
        keep, _ = nucleus(ordered, scaled.logsumexp(dim=-1), rows.top_k, rows.top_p)
        tokens[filtered] = _race(ordered, ids, keep, rows)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Both result vectors in one device-to-host copy (float64 holds the ids exactly)."""
    packed = torch.stack((tokens.double(), logprobs.double())).cpu()
    return [int(t) for t in packed[0].tolist()], packed[1].tolist()
