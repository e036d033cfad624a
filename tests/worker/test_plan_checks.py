"""The worker's one-pass chunk check (``_chunks_pass``) against the per-chunk walk
(``_check_chunks``) that words its errors: on random plans, near the limits and past
them, the fast pass accepts exactly the plans the walk accepts."""

from __future__ import annotations

import random

import pytest

from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.runner.plan_checks import (PlanError, PlanLimits, SequenceState, _check_chunks, _check_diffs, _chunks_pass,
                                chunk_rows)

LIMITS = PlanLimits(num_blocks=64, block_size=4, context_length=40, vocab_size=100, max_num_batched_tokens=48,
                    max_num_seqs=6)


def known_sequences(rng: random.Random) -> dict[int, SequenceState]:
    seqs = {}
    for sid in range(1, 5):
        state = SequenceState(temperature=0.0, top_p=1.0, top_k=0, seed=0,
                              block_table=list(range(sid * 8, sid * 8 + rng.randint(0, 10))))
        state.last_sampled = rng.choice([None, 5])
        seqs[sid] = state
    return seqs


def random_plan(rng: random.Random) -> pb.StepPlan:
    plan = pb.StepPlan(step_id=1)
    if rng.random() < 0.3:
        plan.new_sequences.add(seq_id=7)
    for _ in range(rng.randint(0, 7)):
        sid = rng.choice([1, 2, 3, 4, 7, 9])
        num_ids = rng.choice([0, 1, 1, 2, 17, 30])
        ids = [rng.choice([0, 50, 99, 99, 100]) if rng.random() < 0.2 else 3 for _ in range(num_ids)]
        blocks = [rng.choice([0, 63, 64]) if rng.random() < 0.2 else 1 for _ in range(rng.choice([0, 0, 1, 3, 8]))]
        plan.chunks.add(seq_id=sid, start_position=rng.choice([0, 4, 20, 36, 39]), token_ids=ids,
                        new_block_ids=blocks, last_token_from_sample=rng.random() < 0.4,
                        sample=rng.random() < 0.8, masked=rng.random() < 0.1)
    return plan


@pytest.mark.parametrize("seed", range(4))
def test_the_one_pass_check_accepts_exactly_what_the_walk_accepts(seed: int) -> None:
    rng = random.Random(seed)
    verdicts = {True: 0, False: 0}
    for _ in range(1500):
        seqs = known_sequences(rng)
        plan = random_plan(rng)
        try:
            table_lens, _ = _check_diffs(plan, seqs, LIMITS)
        except PlanError:
            continue
        try:
            _check_chunks(plan, table_lens, LIMITS, seqs)
            walk = True
        except PlanError:
            walk = False
        assert _chunks_pass(plan, chunk_rows(plan), table_lens, LIMITS, seqs) == walk, plan
        verdicts[walk] += 1
    assert min(verdicts.values()) > 50, verdicts   # both verdicts were exercised
