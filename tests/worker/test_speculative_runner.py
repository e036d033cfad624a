"""Speculative decoding end to end on the CPU's batch-invariant path: the
real Scheduler plans, the real ModelRunner verifies (through the wire
encoding), on a tiny random Llama. Token ids and logprobs must be equal
(``==``) with and without speculation:

- through the whole Engine (its stream events, stop strings, n > 1) with the
  ``ngram`` drafter and the load-adaptive rule, greedy and seeded, with
  penalties, min_tokens, logit bias and top logprobs, batched and alone, with
  preemptions (a small cache) and prefix hits (shared prompt prefixes);
- a property test: random drafts forced through the runner (all right, all
  wrong, mixed, per step) give what no speculation gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.plan import to_step_plan
from jitney.scheduler.core.request import FinishReason, Request
from jitney.scheduler.core.scheduler import Scheduler
from jitney.scheduler.core.trace import StepTracer, read_trace
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner
from tests.support.fake_worker import make_request
from tests.support.speculation_engine import (BLOCK, BUDGET, SEATS, VOCAB, AlwaysDraft, Collected,
                                              check_visibility, scheduler_config, serve_requests)
from tests.support.tiny_models import EOS_TOKEN_ID, make_tiny_llama



@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("spec") / "llama", vocab_size=VOCAB)


def make_runner(model: Path, num_blocks: int = 96) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(model), dtype="float32", block_size=BLOCK, num_blocks=num_blocks,
                                    max_num_batched_tokens=BUDGET, max_num_seqs=SEATS, use_weights_cache=False))


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def stop(model: Path, tokenizer: Any) -> tuple[str, ...]:
    """A stop string from the middle of the last request's text (so a stop ends it)."""
    runner = make_runner(model)
    out, _ = asyncio.run(serve_requests(runner, scheduler_config(runner, "off"), tokenizer, True, ("zz",)))
    text = out.text[500]
    return (text[len(text) // 2:len(text) // 2 + 3],)


@pytest.mark.parametrize(("batched", "num_blocks", "drafter"),
                         [(True, 96, "ngram"), (True, 96, "oracle"), (False, 96, "oracle"), (True, 24, "oracle")],
                         ids=["batched-ngram", "batched", "alone", "batched-preempting"])
def test_engine_output_is_the_same_with_speculation(model: Path, tokenizer: Any, stop: tuple[str, ...],
                                                    batched: bool, num_blocks: int, drafter: str,
                                                    tmp_path: Path) -> None:
    """The ngram drafter's own drafts (seldom right on a random model), then drafts
    forced from the output itself (mostly right)."""
    got: dict[str, Collected] = {}
    preemptions: dict[str, int] = {}
    for method in ("off", "ngram"):
        runner = make_runner(model, num_blocks)
        oracle = got["off"] if method == "ngram" and drafter == "oracle" else None
        tracer = StepTracer(tmp_path / f"{method}.jsonl")
        got[method], engine = asyncio.run(serve_requests(runner, scheduler_config(runner, method), tokenizer, batched,
                                                 stop, oracle, tracer))
        tracer.close()
        check_visibility(engine, read_trace(tmp_path / f"{method}.jsonl"))
        preemptions[method] = engine.num_preemptions
        assert engine.scheduler.block_manager.num_used_blocks == 0
        sched = engine.scheduler
        if method == "off":
            assert sched.num_drafts == 0
        elif drafter == "oracle":
            assert sched.num_accepted_tokens > sched.num_draft_tokens // 2, "drafts were not accepted"
            assert sched.num_accepted_tokens < sched.num_draft_tokens   # and some rejected
        else:
            assert sched.num_drafts > 0
    off, on = got["off"], got["ngram"]
    assert off.finish[500] is FinishReason.STOP_SEQUENCE    # the stop string is exercised
    assert on.tokens == off.tokens
    assert on.logprobs == off.logprobs     # bit for bit
    assert on.top == off.top
    assert on.text == off.text
    assert on.finish == off.finish
    assert on.usage == off.usage
    if num_blocks == 24:   # (with drafts, where preemptions fall depends on the schedule)
        assert preemptions["off"] > 0, preemptions


class ScriptedDrafter:
    """Proposes, for each request, the reference continuation with some tokens
    replaced (``pattern``: per draft index, right or wrong), cycling over patterns."""

    def __init__(self, reference: dict[int, list[int]], patterns: Sequence[Sequence[bool]]) -> None:
        self.reference, self.patterns, self.calls = reference, patterns, 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        pattern = self.patterns[self.calls % len(self.patterns)]
        self.calls += 1
        done = request.num_output_tokens
        right = self.reference[request.seq_id][done:done + max_tokens]
        return [t if ok else (t + 1 + i) % VOCAB for i, (t, ok) in enumerate(zip(right, pattern))]

    def forget(self, seq_id: int) -> None:
        pass


def _forced_requests() -> list[Request]:
    return [
        make_request(1, [5, 17, 42, 99, 3, 250, 7], max_tokens=14, ignore_eos=True),
        make_request(2, [300, 2, 19, 77, 140], max_tokens=12, temperature=0.8, seed=11, top_k=50,
                     ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        make_request(3, list(range(30, 45)), max_tokens=10, min_tokens=4, top_logprobs=2, temperature=0.6,
                     seed=2, top_p=0.8),
    ]


def _drive(runner: ModelRunner, sched: Scheduler, requests: list[Request]) -> list[tuple[list[int], list[float]]]:
    for r in requests:
        sched.add_request(r)
    while sched.has_work():
        output = sched.schedule()
        sched.check_invariants()
        plan = engine_pb2.StepPlan.FromString(to_step_plan(output, frozenset({EOS_TOKEN_ID})).SerializeToString())
        result = runner.execute(plan)
        sched.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        sched.check_invariants()
        null = sched.block_manager.null_block    # (a released entry: the worker keeps the old id)
        for r in sched._running:   # both sides cut the table the same way
            table = runner.sequences[r.seq_id].block_table
            assert len(table) == len(r.block_ids)
            assert all(mine == theirs for mine, theirs in zip(table, r.block_ids) if theirs != null)
            assert runner.sequences[r.seq_id].num_computed == r.num_computed_tokens
    assert sched.block_manager.num_used_blocks == 0
    return [(r.output_token_ids, r.output_logprobs) for r in requests]


@pytest.fixture(scope="module")
def forced(model: Path) -> dict[str, Any]:
    runner = make_runner(model)
    reference = _drive(runner, Scheduler(scheduler_config(runner, "off")), _forced_requests())
    return {"runner": runner, "reference": reference}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(patterns=st.lists(st.lists(st.booleans(), min_size=1, max_size=4), min_size=1, max_size=4)
       | st.sampled_from([[[True] * 4], [[False] * 4]]))
def test_random_drafts_through_the_runner_change_nothing(forced: dict[str, Any], patterns: list[list[bool]]) -> None:
    runner: ModelRunner = forced["runner"]
    reference = forced["reference"]
    runner.execute(engine_pb2.StepPlan(step_id=1, reset=True))    # a fresh worker state for each example
    config = scheduler_config(runner, "ngram", k=4)
    requests = _forced_requests()
    drafter = ScriptedDrafter({r.seq_id: out for r, (out, _) in zip(requests, reference)}, patterns)
    sched = Scheduler(config, frozenset({EOS_TOKEN_ID}), drafter=drafter, speculation=AlwaysDraft(4))
    got = _drive(runner, sched, requests)
    assert got == reference
    assert sched.num_drafts > 0
    if all(all(p) for p in patterns):
        assert sched.num_accepted_tokens == sched.num_draft_tokens
    if not any(any(p) for p in patterns):
        assert sched.num_accepted_tokens == 0


def test_default_model_copying_accepts_drafts_and_changes_nothing() -> None:
    """The default model (bf16) restating its prompt (spec-edit-32's first
    requests): the ngram drafter's drafts are mostly right, and the tokens and
    logprobs, greedy and seeded, are those of no speculation."""
    import json

    lines = (Path(__file__).resolve().parents[2] / "bench" / "workloads" / "spec-edit-32.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt_token_ids"] for line in lines[:2]]
    runner = ModelRunner(WorkerConfig(block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4))
    ready = runner.ready_message()

    def requests() -> list[Request]:
        return [make_request(1, prompts[0], max_tokens=16, ignore_eos=True),
                make_request(2, prompts[1], max_tokens=16, ignore_eos=True, temperature=0.7, seed=7)]

    results, scheds = {}, {}
    for method in ("off", "ngram"):
        runner.execute(engine_pb2.StepPlan(step_id=1, reset=True))
        config = SchedulerConfig(block_size=16, num_blocks=ready.num_blocks, max_model_len=1024, max_num_seqs=4,
                                 max_num_batched_tokens=64, speculative=method, num_speculative_tokens=6)  # type: ignore[arg-type]
        scheds[method] = Scheduler(config, frozenset(ready.eos_token_ids))
        results[method] = _drive(runner, scheds[method], requests())
    assert results["ngram"] == results["off"]
    on = scheds["ngram"]
    assert on.num_accepted_tokens >= on.num_draft_tokens // 2 > 0, (on.num_accepted_tokens, on.num_draft_tokens)


def test_a_follower_rank_rolls_back_as_rank_0(model: Path) -> None:
    """Tensor parallelism's ranks > 0 run every plan without sampling and learn the
    tokens (so how many drafts were accepted) from those rank 0 relays with the
    next plan (``note_samples``): their sequences end up as rank 0's."""
    leader, follower = make_runner(model), make_runner(model)
    follower.samples = False     # (as a rank > 0: the forward only)
    requests = _forced_requests()
    reference = {r.seq_id: out for r, (out, _) in zip(requests, _drive(leader, Scheduler(
        scheduler_config(leader, "off")), _forced_requests()))}
    leader.execute(engine_pb2.StepPlan(step_id=1, reset=True))
    sched = Scheduler(scheduler_config(leader, "ngram", k=4), frozenset({EOS_TOKEN_ID}),
                      drafter=ScriptedDrafter(reference, [[True, True, False], [True], [False]]),
                      speculation=AlwaysDraft(4))
    for r in requests:
        sched.add_request(r)
    relayed: tuple[list[int], list[int]] = ([], [])
    while sched.has_work():
        output = sched.schedule()
        plan = engine_pb2.StepPlan.FromString(to_step_plan(output, frozenset({EOS_TOKEN_ID})).SerializeToString())
        result = leader.execute(plan)
        follower.note_samples(*relayed)
        follower.execute(plan)
        relayed = (list(result.seq_ids), list(result.token_ids))
        sched.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        follower.note_samples(*relayed)     # (what the next plan would bring)
        relayed = ([], [])
        for sid, state in leader.sequences.items():
            mine = follower.sequences[sid]
            assert (mine.num_computed, mine.block_table, mine.last_sampled) == \
                (state.num_computed, state.block_table, state.last_sampled)
    assert sched.num_drafts > 0 and 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    assert [r.output_token_ids for r in requests] == [reference[r.seq_id] for r in requests]


def test_forced_drafts_on_a_windowed_model(tmp_path: Path) -> None:
    """A Mistral whose every layer is windowed (7 keys): blocks before the window go
    back to the pool as requests grow, drafts verified or not; same bits as without."""
    from jitney.scheduler.core.config import max_model_len_for
    from tests.support.tiny_models import make_tiny_mistral

    runner = make_runner(make_tiny_mistral(tmp_path / "mistral", window=7))
    ready = runner.ready_message()

    def config(method: str) -> SchedulerConfig:
        return SchedulerConfig(block_size=ready.block_size, num_blocks=ready.num_blocks, max_num_seqs=SEATS,
                               max_num_batched_tokens=BUDGET, sliding_window=ready.sliding_window,
                               max_model_len=max_model_len_for(ready.context_length, ready.num_blocks,
                                                               ready.block_size, ready.sliding_window, BUDGET),
                               speculative=method, num_speculative_tokens=4)  # type: ignore[arg-type]

    assert ready.sliding_window == 7
    reference = _drive(runner, Scheduler(config("off")), _forced_requests())
    runner.execute(engine_pb2.StepPlan(step_id=1, reset=True))
    requests = _forced_requests()
    sched = Scheduler(config("ngram"), frozenset({EOS_TOKEN_ID}), speculation=AlwaysDraft(4),
                      drafter=ScriptedDrafter({r.seq_id: out for r, (out, _) in zip(requests, reference)},
                                              [[True, True, True, False], [True], [False, True]]))
    assert _drive(runner, sched, requests) == reference
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
