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
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.engine import Engine, StreamEvent
from jitney.scheduler.core.plan import to_step_plan
from jitney.scheduler.core.request import FinishReason, Request, SamplingOptions, ValidatedRequest
from jitney.scheduler.core.scheduler import Scheduler
from jitney.scheduler.core.speculative import DraftCandidate, SpeculationPolicy
from jitney.scheduler.core.trace import StepTracer, read_trace
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner
from tests.support.fake_worker import make_request
from tests.support.tiny_models import EOS_TOKEN_ID, make_tiny_llama

BLOCK, BUDGET, SEATS, VOCAB = 4, 32, 6, 320


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("spec") / "llama", vocab_size=VOCAB)


def make_runner(model: Path, num_blocks: int = 96) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(model), dtype="float32", block_size=BLOCK, num_blocks=num_blocks,
                                    max_num_batched_tokens=BUDGET, max_num_seqs=SEATS, use_weights_cache=False))


def scheduler_config(runner: ModelRunner, speculative: str, k: int = 5) -> SchedulerConfig:
    ready = runner.ready_message()
    return SchedulerConfig(block_size=ready.block_size, num_blocks=ready.num_blocks,
                           max_model_len=min(128, ready.num_blocks * ready.block_size),
                           max_num_seqs=SEATS, max_num_batched_tokens=BUDGET,
                           speculative=speculative, num_speculative_tokens=k)  # type: ignore[arg-type]


class InProcessLink:
    """The engine's link to a ModelRunner in this process: plans run in order,
    each when its result is asked for (so the engine's overlap stays as it is)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.plans: list[engine_pb2.StepPlan] = []
        self.results: dict[int, engine_pb2.StepResult] = {}

    async def send_plan(self, plan: engine_pb2.StepPlan) -> None:
        self.plans.append(engine_pb2.StepPlan.FromString(plan.SerializeToString()))

    async def receive_result(self, step_id: int) -> engine_pb2.StepResult:
        while step_id not in self.results:
            plan = self.plans.pop(0)
            self.results[plan.step_id] = engine_pb2.StepResult.FromString(
                self.runner.execute(plan).SerializeToString())
        return self.results.pop(step_id)

    async def send_masks(self, masks: engine_pb2.StepMasks) -> None:
        raise AssertionError("no grammar in these tests")


@dataclass
class Collected:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    top: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, FinishReason | None] = field(default_factory=dict)
    usage: int = 0


def _requests(stop: tuple[str, ...] = ("zz",)) -> list[tuple[list[int], SamplingOptions]]:
    loop = [11, 12, 13, 14, 15, 16]
    prefix = [40 + i for i in range(18)]       # shared by several: prefix-cache hits
    opts = SamplingOptions
    return [
        (loop * 3, opts(max_tokens=30, ignore_eos=True)),
        (prefix + [7, 8], opts(max_tokens=24, ignore_eos=True, temperature=0.7, seed=5, top_k=40)),
        (prefix + [9], opts(max_tokens=24, ignore_eos=True, temperature=0.3, seed=9, top_p=0.9,
                            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)),
        (loop * 2 + [3], opts(max_tokens=20, min_tokens=6, logit_bias=((13, 2.0),), top_logprobs=3)),
        (prefix + [5, 6], opts(max_tokens=16, n=2, temperature=0.5, seed=3, ignore_eos=True)),
        ([20, 21, 22, 20, 21, 22, 20], opts(max_tokens=28, ignore_eos=True, stop=stop)),
    ]


async def _serve(runner: ModelRunner, config: SchedulerConfig, tokenizer: Any, batched: bool,
                 stop: tuple[str, ...], oracle: Collected | None = None,
                 tracer: StepTracer | None = None) -> tuple[Collected, Engine]:
    """Serve ``_requests(stop)``; with ``oracle`` (an earlier run's output), its
    tokens are forced as drafts (corrupted at times) instead of the ngram drafter's.
    Every proposal is verified (AlwaysDraft): the adaptive rule decides from measured
    step times, so whether it drafts here would depend on the machine's load (its
    choices are tested in tests/scheduler/test_speculative.py)."""
    engine = Engine(config, InProcessLink(runner), tokenizer, frozenset({EOS_TOKEN_ID}),  # type: ignore[arg-type]
                    vocab_size=VOCAB, tracer=tracer)
    requests = _requests(stop)
    if oracle is not None:
        by_prompt = {(tuple(p), k % 100): oracle.tokens[k] for i, (p, _) in enumerate(requests)
                     for k in oracle.tokens if k // 100 == i}
        engine.scheduler._drafter = OracleDrafter(by_prompt)
    if config.speculative != "off":
        engine.scheduler.speculation = AlwaysDraft(config.num_speculative_tokens)
    loop = asyncio.create_task(engine.run())
    out = Collected()

    async def one(i: int, prompt: list[int], sampling: SamplingOptions) -> None:
        handle = engine.submit(ValidatedRequest(tuple(prompt), sampling, f"r{i}"))
        async for event in handle.stream():
            assert event.error is None, event.error
            key = i * 100 + event.sample_index
            _collect(out, key, event)

    try:
        if batched:
            await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))
        else:
            for i, (p, s) in enumerate(requests):
                await one(i, p, s)
    finally:
        engine.close("done")
        await asyncio.wait_for(loop, 30)
    return out, engine


def _collect(out: Collected, key: int, event: StreamEvent) -> None:
    out.tokens.setdefault(key, []).extend(event.token_ids)
    out.logprobs.setdefault(key, []).extend(event.logprobs)
    out.top.setdefault(key, []).extend(event.top_logprobs)
    out.text[key] = out.text.get(key, "") + event.text
    if event.finish_reason is not None:
        out.finish[key] = event.finish_reason
    out.usage += event.completion_tokens


class OracleDrafter:
    """Drafts a run's known output (keyed by prompt and sample index), every third
    proposal with its last token wrong."""

    def __init__(self, outputs: dict[tuple[tuple[int, ...], int], list[int]]) -> None:
        self.outputs, self.calls = outputs, 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        done = request.num_output_tokens
        right = self.outputs[(tuple(request.prompt_token_ids), request.sample_index)][done:done + max_tokens]
        self.calls += 1
        if right and self.calls % 3 == 0:
            right[-1] = (right[-1] + 1) % VOCAB
        return right

    def forget(self, seq_id: int) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def stop(model: Path, tokenizer: Any) -> tuple[str, ...]:
    """A stop string from the middle of the last request's text (so a stop ends it)."""
    runner = make_runner(model)
    out, _ = asyncio.run(_serve(runner, scheduler_config(runner, "off"), tokenizer, True, ("zz",)))
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
        got[method], engine = asyncio.run(_serve(runner, scheduler_config(runner, method), tokenizer, batched,
                                                 stop, oracle, tracer))
        tracer.close()
        _check_visibility(engine, read_trace(tmp_path / f"{method}.jsonl"))
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


def _check_visibility(engine: Engine, trace: list[dict[str, Any]]) -> None:
    """The step trace, the Prometheus metrics and the scheduler agree on the drafts."""
    from jitney.scheduler.api.metrics import Metrics

    sched = engine.scheduler
    assert sum(s["draft_tokens"] for s in trace) == sched.num_draft_tokens
    assert sum(s["accepted_tokens"] for s in trace) == sched.num_accepted_tokens
    families = {f.name: f for f in Metrics(lambda: engine).registry.collect()}
    assert families["jitney:spec_decode_num_draft_tokens"].samples[0].value == sched.num_draft_tokens
    assert families["jitney:spec_decode_num_accepted_tokens"].samples[0].value == sched.num_accepted_tokens
    histogram = {s.labels.get("le"): s.value for s in families["jitney:spec_decode_acceptance_length"].samples
                 if s.name.endswith("_bucket")}
    assert histogram["+Inf"] == sched.num_drafts


# -- forced drafts through the runner -------------------------------------------------


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


class AlwaysDraft(SpeculationPolicy):
    """Every proposal drafted whole (the rule is not under test here)."""

    def worth_drafting(self, seq_id: int, num_tokens: int, num_seqs: int) -> bool:
        return True

    def draft_lengths(self, candidates: Sequence[DraftCandidate], num_tokens: int, num_seqs: int,
                      budget: int) -> dict[int, int]:
        lengths: dict[int, int] = {}
        for c in candidates:
            k = min(len(c.proposal), self.num_speculative_tokens, budget)
            if k:
                lengths[c.seq_id] = k
                budget -= k
        return lengths


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
