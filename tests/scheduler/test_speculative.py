"""Speculative decoding on the scheduler's side: the n-gram drafter, the
load-adaptive rule, and the budget and block accounting of speculating
sequences, driven through the fake worker (which runs the real plan checks
and the real rollback rule, ``accept_drafts``)."""

from __future__ import annotations

import random

import pytest

from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.request import FinishReason, Request
from jitney.scheduler.core.scheduler import Scheduler
from jitney.scheduler.core.speculative import NgramIndex, SpeculationPolicy, DraftCandidate, StepCostModel
from tests.support.fake_worker import VOCAB, FakeWorker, drive_step, make_request, run_until_idle, wire_plan


def periodic(period: int, window: int = 0):  # type: ignore[no-untyped-def]
    """A fake model that repeats the token ``period`` back (its drafts are often right),
    with a twist every 7th position so that some drafts are wrong; with a ``window``
    it reads only the last ``window`` tokens, as a windowed model."""
    def model(history: list[int]) -> int:
        n = len(history)
        if n % 7 == 0:
            return (sum(history[-window:] if window else history) * 31 + n) % VOCAB
        return history[-period] if n >= period else (n * 13) % VOCAB
    return model


def test_ngram_index_proposes_what_followed_the_longest_match() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    # "2 3" ends the sequence; its latest earlier occurrence (at 5..6) was followed by 5 6 7.
    assert index.propose(3) == [5, 6, 7]
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], [4])
    # "2 3 4" (a 3-gram) only occurred at 1..3: followed by 9 2 3 5.
    assert index.propose(4) == [9, 2, 3, 5]
    assert index.propose(0) == []
    fresh = NgramIndex()
    fresh.extend([5, 6, 7])
    assert fresh.propose(4) == []   # nothing repeats: no proposal


def test_ngram_index_stays_incremental() -> None:
    """Growing one token at a time gives the same proposals as indexing at once."""
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(200)]
    grown = NgramIndex()
    for end in range(1, len(tokens) + 1):
        grown.extend(tokens[:end])
        whole = NgramIndex()
        whole.extend(tokens[:end])
        assert grown.propose(5) == whole.propose(5)


def _config(speculative: str = "ngram", **kwargs: object) -> SchedulerConfig:
    base: dict[str, object] = dict(block_size=4, num_blocks=64, max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=32, speculative=speculative, num_speculative_tokens=5)
    base.update(kwargs)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _requests(n: int, max_tokens: int = 40, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        motif = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 6))]
        prompt = (motif * 8)[:rng.randrange(6, 30)]
        reqs.append(make_request(i + 1, prompt, max_tokens=max_tokens))
    return reqs


def _run(config: SchedulerConfig, requests: list[Request], period: int = 3) -> tuple[Scheduler, FakeWorker]:
    scheduler = Scheduler(config)
    worker = FakeWorker.for_config(config, model=periodic(period, config.sliding_window))
    for r in requests:
        scheduler.add_request(r)
    run_until_idle(scheduler, worker)
    return scheduler, worker


@pytest.mark.parametrize("kwargs", [{}, {"num_blocks": 20, "max_model_len": 64},   # preemptions
                                    {"max_num_batched_tokens": 8, "max_num_seqs": 4},
                                    {"enable_prefix_caching": False},
                                    {"sliding_window": 8, "num_blocks": 40},      # windowed: blocks released
                                    {"max_model_len": 36}])                       # context-length ends
def test_speculation_changes_no_token_and_leaks_no_block(kwargs: dict[str, object]) -> None:
    off, _ = _run(_config("off", **kwargs), reqs_off := _requests(6))
    on, worker = _run(_config("ngram", **kwargs), reqs_on := _requests(6))
    for a, b in zip(reqs_off, reqs_on):
        assert b.output_token_ids == a.output_token_ids
        assert b.output_logprobs == a.output_logprobs
        assert b.finish_reason == a.finish_reason
    assert on.num_drafts > 0 and on.num_accepted_tokens > 0       # drafts were verified and accepted
    assert on.num_accepted_tokens < on.num_draft_tokens            # and some were rejected
    assert worker.num_accepted == on.num_accepted_tokens
    assert sum(on.acceptance_counts) == on.num_drafts
    assert on.block_manager.num_used_blocks == 0
    on.check_invariants()
    if kwargs.get("num_blocks") == 20:
        assert sum(r.num_preemptions for r in reqs_on) > 0


def test_speculating_steps_keep_the_budget_and_the_tables() -> None:
    config = _config(max_num_batched_tokens=12, max_num_seqs=4)
    scheduler = Scheduler(config)
    worker = FakeWorker.for_config(config, model=periodic(2))
    for r in _requests(4, max_tokens=30, seed=5):
        scheduler.add_request(r)
    drafted_steps = 0
    while scheduler.has_work():
        output, _ = drive_step(scheduler, worker)    # checks the budget, seats and invariants
        drafted = [c for c in output.scheduled if c.num_draft_tokens]
        drafted_steps += bool(drafted)
        for c in drafted:
            assert c.num_new_tokens == 1 + c.num_draft_tokens <= 1 + config.num_speculative_tokens
            assert c.sample and not c.last_token_from_sample
        # After the result, each running table holds exactly what its accepted positions need.
        for r in scheduler._running:
            assert len(r.block_ids) == -(-r.num_computed_tokens // config.block_size)
            assert worker.seqs[r.seq_id].block_table == r.block_ids
    assert drafted_steps > 0
    assert scheduler.block_manager.num_used_blocks == 0


def test_rule_learns_its_cost_from_decode_steps_only() -> None:
    """A draft is priced as a sampled row: steps with prefill chunks (tokens that
    skip the head and the sampler) do not enter the rule's cost model."""
    config = _config(max_num_batched_tokens=16, max_num_seqs=4)
    scheduler = Scheduler(config)
    worker = FakeWorker.for_config(config, model=periodic(3))
    for r in _requests(4, max_tokens=12, seed=3):
        scheduler.add_request(r)
    assert scheduler.speculation is not None
    seen = {"prefill": 0, "decode": 0}
    while scheduler.has_work():
        before = scheduler.speculation.cost.num_observed
        output, _ = drive_step(scheduler, worker)
        scheduler.observe_step_time(output, 0.01)
        if not output.scheduled:
            continue            # (an empty step has no time to learn from)
        decode_only = all(c.num_new_tokens == 1 + c.num_draft_tokens for c in output.scheduled)
        seen["decode" if decode_only else "prefill"] += 1
        assert scheduler.speculation.cost.num_observed == min(before + decode_only, 64)
    assert seen["prefill"] and seen["decode"]     # both kinds of step were met


def test_drafts_never_exceed_max_tokens() -> None:
    for max_tokens in (1, 2, 3, 7):
        scheduler, _ = _run(_config(), reqs := _requests(3, max_tokens=max_tokens, seed=max_tokens))
        for r in reqs:
            assert r.num_output_tokens == max_tokens and r.finish_reason is FinishReason.LENGTH


def test_stop_token_inside_accepted_drafts_ends_there() -> None:
    """A stop id among the accepted tokens ends the request at it, as without drafts."""
    def run(speculative: str) -> Request:
        scheduler = Scheduler(_config(speculative))
        worker = FakeWorker.for_config(scheduler.config, model=periodic(3))
        first = make_request(1, [11, 12, 13] * 4, max_tokens=30)
        scheduler.add_request(first)
        run_until_idle(scheduler, worker)
        stop = first.output_token_ids[9]
        request = make_request(2, [11, 12, 13] * 4, max_tokens=30, stop_token_ids=frozenset({stop}))
        scheduler = Scheduler(_config(speculative))
        worker = FakeWorker.for_config(scheduler.config, model=periodic(3))
        scheduler.add_request(request)
        run_until_idle(scheduler, worker)
        assert scheduler.block_manager.num_used_blocks == 0
        return request

    off, on = run("off"), run("ngram")
    assert on.output_token_ids == off.output_token_ids and on.finish_reason is FinishReason.END_OF_SEQUENCE


def test_rule_drafts_nothing_when_tokens_cost_linearly_at_load() -> None:
    policy = SpeculationPolicy(num_speculative_tokens=4)
    for tokens in range(1, 80, 3):       # compute-bound: 1 ms per token, nothing fixed
        policy.cost.observe(tokens, 0.001 * tokens)
    many = [DraftCandidate(i, [1, 2, 3, 4]) for i in range(64)]
    assert policy.draft_lengths(many, num_tokens=64, num_seqs=64, budget=448) == {}
    # Alone, a well-accepted sequence drafts all it may: one token costs as much, but t / N is the whole step.
    for _ in range(5):
        policy.observe(0, 4, 4)
    weight_bound = SpeculationPolicy(num_speculative_tokens=4)
    for tokens in range(1, 80, 3):       # weight-bound: 30 ms a step, 0.05 ms per token
        weight_bound.cost.observe(tokens, 0.030 + 0.00005 * tokens)
    for _ in range(5):
        weight_bound.observe(0, 4, 4)
    assert weight_bound.draft_lengths([DraftCandidate(0, [1, 2, 3, 4])], 1, 1, 100) == {0: 4}
    # ... and at 64 sequences, a weight-bound step still drafts for the sequences that are often right.
    assert weight_bound.draft_lengths(many[:1], 64, 64, 448) == {0: 4}


def test_rule_drafts_less_for_sequences_rarely_right() -> None:
    policy = SpeculationPolicy(num_speculative_tokens=4)
    for tokens in range(1, 40, 2):
        policy.cost.observe(tokens, 0.010 + 0.0002 * tokens)
    for _ in range(10):
        policy.observe(1, 4, 0)     # always wrong
        policy.observe(2, 4, 4)     # always right
    lengths = policy.draft_lengths([DraftCandidate(1, [5] * 4), DraftCandidate(2, [5] * 4)], 16, 16, 100)
    assert lengths.get(2, 0) > lengths.get(1, 0)


def test_cost_model_fit() -> None:
    model = StepCostModel()
    assert model.fit() == (1.0, 1.0 / 32)
    for tokens in (1, 5, 9, 1, 5, 9):
        model.observe(tokens, 0.02 + 0.001 * tokens)
    a, b = model.fit()
    assert a == pytest.approx(0.02) and b == pytest.approx(0.001)


def test_config_validates_speculation() -> None:
    with pytest.raises(ValueError, match="speculative must be one of"):
        _config("eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _config(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _config(num_speculative_tokens=32, max_num_batched_tokens=32)


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_draft_tokens": 3, "sample": True}, "leave no token before them"),
    ({"num_draft_tokens": 1, "sample": False}, "must sample"),
    ({"num_draft_tokens": 1, "sample": True, "masked": True}, "grammar mask"),
])
def test_worker_refuses_malformed_drafts(fields: dict[str, object], message: str) -> None:
    from jitney.engine.v1 import engine_pb2
    from tests.support.fake_worker import PlanError

    worker = FakeWorker(16, 4)
    plan = engine_pb2.StepPlan(step_id=1, new_sequences=[engine_pb2.NewSequence(seq_id=1)], chunks=[
        engine_pb2.ScheduledChunk(seq_id=1, start_position=0, token_ids=[5, 6, 7], new_block_ids=[0],
                                  **fields)])  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=message):
        worker.execute(plan)
    assert not worker.seqs        # refused whole: nothing applied


def test_a_request_cancelled_while_its_drafts_are_verified() -> None:
    """Aborted between plan and result: the result's tokens are dropped, every
    block is back, and the worker forgets the sequence in the next plan."""
    config = _config()
    scheduler = Scheduler(config)
    worker = FakeWorker.for_config(config, model=periodic(3))
    request = make_request(1, [11, 12, 13] * 4, max_tokens=30)
    scheduler.add_request(request)
    while True:
        output = scheduler.schedule()
        result = worker.execute(wire_plan(output))
        if any(c.num_draft_tokens for c in output.scheduled):
            break
        scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
    emitted = request.num_output_tokens
    scheduler.abort_request(1, FinishReason.CANCELLED)
    assert scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids),
                                        list(result.logprobs)) == []
    assert request.num_output_tokens == emitted and scheduler.block_manager.num_used_blocks == 0
    scheduler.check_invariants()
    final = scheduler.schedule()
    assert final.freed_seq_ids == [1]
    worker.execute(wire_plan(final))
    assert not worker.seqs and not worker.holders


def test_suffix_drafter_proposes_from_recent_sequences_of_the_same_salt_only() -> None:
    from jitney.scheduler.core.speculative import SuffixDrafter

    drafter = SuffixDrafter(max_tokens=40)
    done = make_request(1, [7, 8, 9, 10, 11, 12, 13, 14], max_tokens=4)
    done.output_token_ids = [15, 16]
    assert drafter.propose(done, 3) == []          # nothing repeats in itself
    drafter.forget(1)                              # finished: its text is kept for its salt
    assert drafter.kept("") == (1, 10)
    again = make_request(2, [1, 2, 9, 10, 11], max_tokens=4)
    assert drafter.propose(again, 3) == [12, 13, 14]
    other = make_request(3, [1, 2, 9, 10, 11], max_tokens=4)
    other.cache_salt = "tenant-b"
    assert drafter.propose(other, 3) == []         # another tenant never sees it
    # Bounded: older sequences leave once the salt's tokens pass the budget.
    for seq_id in range(10, 16):
        r = make_request(seq_id, [200 + seq_id] * 3 + [300 + seq_id] * 5, max_tokens=4)
        drafter.propose(r, 1)
        drafter.forget(seq_id)
    sequences, tokens = drafter.kept("")
    assert tokens <= 40 and sequences < 7
    assert drafter.propose(make_request(20, [1, 2, 9, 10, 11], max_tokens=4), 3) == []   # seq 1 is gone


def test_suffix_speculation_changes_no_token() -> None:
    off, _ = _run(_config("off"), reqs_off := _requests(6))
    on, _ = _run(_config("suffix"), reqs_on := _requests(6))
    assert [r.output_token_ids for r in reqs_on] == [r.output_token_ids for r in reqs_off]
    assert on.num_accepted_tokens > 0 and on.block_manager.num_used_blocks == 0


# -- the draft model's side in the scheduler ------------------------------------------


def test_model_drafter_uses_a_proposal_only_where_it_was_made() -> None:
    """A proposal made for a sequence of N tokens drafts while it still has N, never
    after (a step planned before it came in moved the sequence on: stale)."""
    from jitney.scheduler.core.speculative import ModelDrafter

    drafter = ModelDrafter()
    request = make_request(1, [5, 6, 7], max_tokens=8)
    drafter.receive(1, 3, [8, 9, 10])
    assert drafter.propose(request, 2) == [8, 9]
    request.output_token_ids.append(8)
    assert drafter.propose(request, 2) == []     # stale
    drafter.receive(1, 4, [9])
    assert drafter.propose(request, 4) == [9]
    drafter.forget(1)
    assert drafter.propose(request, 4) == [] and drafter.num_kept == 0


def test_rule_switches_a_costly_draft_model_off() -> None:
    """The draft model's time per token is part of a draft's cost: a draft that is
    seldom right and costs more than the step's share of a token is not asked for."""
    policy = SpeculationPolicy(num_speculative_tokens=4)
    for tokens in (1, 8, 16, 32, 64):   # weight-bound: 10 ms a step, 0.05 ms a token
        policy.cost.observe(tokens, 0.010 + 0.00005 * tokens)
    assert policy.worth_drafting(1, 1, 1)      # cheap verification, a prior of 0.5: yes
    for _ in range(6):
        policy.observe(1, 4, 0)                # never right
    policy.observe_draft(0.004, 4)             # 1 ms per drafted token
    assert policy.draft_seconds_per_token == pytest.approx(0.001)
    assert not policy.worth_drafting(1, 1, 1)
    assert policy.draft_lengths([DraftCandidate(1, [1, 2, 3, 4])], 1, 1, 100) == {}
    for _ in range(6):
        policy.observe(2, 4, 4)                # a sequence the draft gets right
    assert policy.worth_drafting(2, 1, 1)
    policy.observe_draft(0.0, 0)               # (nothing proposed: nothing learnt)
    assert policy.draft_seconds_per_token == pytest.approx(0.001)


def test_scheduler_asks_for_proposals_and_drafts_them() -> None:
    """``--speculative draft``: a sampling chunk asks the worker for as many
    proposals as the next step may verify (never past max_tokens); the proposals
    that come back are drafted at the next step and verified as any drafts."""
    from tests.support.speculation_engine import AlwaysDraft

    sched = Scheduler(_config("draft", num_speculative_tokens=3), speculation=AlwaysDraft(3))
    request = make_request(1, [5, 6, 7], max_tokens=4)
    sched.add_request(request)
    first = sched.schedule()
    assert [c.num_proposals for c in first.scheduled] == [2]     # the next step's cap: 4 - 1 - 1
    sched.update_from_output(first, [1], [8], [-0.5])
    sched.take_proposals([(1, 4, [9, 10]), (77, 1, [3])], seconds=0.002, num_tokens=3)   # (77: not live)
    second = sched.schedule()
    chunk = second.scheduled[0]
    assert chunk.token_ids == [8, 9, 10] and chunk.num_draft_tokens == 2
    assert chunk.num_proposals == 1    # (were a draft rejected, one more token could follow)
    sched.update_from_output(second, [1, 1, 1], [9, 10, 11], [-0.1, -0.2, -0.3])
    assert request.output_token_ids == [8, 9, 10, 11] and request.is_finished
    assert sched.num_accepted_tokens == 2
    assert sched._drafter.num_kept == 0   # type: ignore[union-attr]
