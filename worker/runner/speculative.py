"""Verifying drafts (speculative decoding), the worker's part of a step.

A chunk with ``num_draft_tokens = d`` is sampled at each of its last d + 1
positions (``InputBatch.stage`` makes a sampled row of each, sampling as a
decode at that position would). Its drafts are accepted while each equals
the choice at its position; the choices up to the first that differs (or
the one after the last draft) are the sequence's tokens of the step, and
both sides roll the sequence back to the accepted positions
(``plan_checks.accept_drafts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jitney.worker.runner.input_batch import InputBatch, StagedStep, StepChunk
from jitney.worker.runner.plan_checks import ChunkRow, SequenceState, accept_drafts


class Verdict(NamedTuple):
    """Which of a step's S sampled rows yield tokens, and per verifying
    sequence its drafts and how many were accepted."""

    kept: list[bool]
    accepted: dict[int, tuple[int, list[int]]]   # seq id -> (accepted, drafts)


def verify(step: StagedStep, chunks: Sequence[StepChunk], tokens: Sequence[int]) -> Verdict:
    """Accept each verifying chunk's drafts against the step's choices ``tokens`` (S,)."""
    kept = [True] * step.num_sampled
    by_seq = {c.seq_id: c for c in chunks if c.num_drafts}
    accepted: dict[int, tuple[int, list[int]]] = {}
    row = 0
    while row < step.num_sampled:
        chunk = by_seq.get(step.sampled_seq_ids[row])
        if chunk is None:
            row += 1
            continue
        drafts = [int(t) for t in chunk.tokens[len(chunk.tokens) - chunk.num_drafts:]]
        n = 0
        while n < chunk.num_drafts and tokens[row + n] == drafts[n]:
            n += 1
        for j in range(n + 1, chunk.num_drafts + 1):
            kept[row + j] = False
        accepted[chunk.seq_id] = (n, drafts)
        row += chunk.num_drafts + 1
    return Verdict(kept, accepted)


def kept_rows(step: StagedStep, kept: Sequence[bool], tokens: Sequence[int], logprobs: Sequence[float],
              top_ids: Sequence[int], top_logprobs: Sequence[float]
              ) -> tuple[list[int], list[float], list[int], list[float]]:
    """The draw (ids, logprobs, flattened top logprobs: each row with top_n > 0 has
    its own N, in row order) of the kept rows only."""
    ids: list[int] = []
    lps: list[float] = []
    at = 0
    for i in np.flatnonzero(step.top_n).tolist():
        n = int(step.top_n[i])
        if kept[i]:
            ids += top_ids[at:at + n]
            lps += top_logprobs[at:at + n]
        at += n
    return ([t for t, k in zip(tokens, kept) if k], [v for v, k in zip(logprobs, kept) if k], ids, lps)


def roll_back(state: SequenceState, batch: InputBatch, row: ChunkRow, accepted: int, block_size: int,
              rejected: Sequence[int] = ()) -> None:
    """A verified chunk's outcome (``accept_drafts``): the sequence computed up to
    its accepted drafts, its table and its batch row's cut to what they need, its
    penalty counts without the ``rejected`` drafts (rank 0, which samples)."""
    accept_drafts(state, row, accepted, block_size)
    batch.truncate_blocks(row.seq_id, len(state.block_table))
    if rejected and batch.any_penalised:
        batch.uncount_rejected(row.seq_id, np.array(rejected, dtype=np.int64))
