"""Speculative decoding through the whole Engine against a ModelRunner in this
process (tests/worker/test_speculative_runner.py, tests/worker/test_draft_model.py):
the tiny model's step limits, an in-process link, a mix of requests (greedy,
seeded, penalties, min_tokens, logit bias, top logprobs, n = 2, a stop
string) served batched or one at a time, and a rule that drafts every proposal."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.engine import Engine, StreamEvent
from jitney.scheduler.core.request import FinishReason, Request, SamplingOptions, ValidatedRequest
from jitney.scheduler.core.speculative import DraftCandidate, SpeculationPolicy
from jitney.scheduler.core.trace import StepTracer
from jitney.worker.runner.model_runner import ModelRunner
from tests.support.tiny_models import EOS_TOKEN_ID

BLOCK, BUDGET, SEATS, VOCAB = 4, 32, 6, 320


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


def mixed_requests(stop: tuple[str, ...] = ("zz",)) -> list[tuple[list[int], SamplingOptions]]:
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


async def serve_requests(runner: ModelRunner, config: SchedulerConfig, tokenizer: Any, batched: bool,
                 stop: tuple[str, ...], oracle: Collected | None = None,
                 tracer: StepTracer | None = None) -> tuple[Collected, Engine]:
    """Serve ``mixed_requests(stop)``; with ``oracle`` (an earlier run's output), its
    tokens are forced as drafts (corrupted at times) instead of the ngram drafter's.
    Every proposal is verified (AlwaysDraft): the adaptive rule decides from measured
    step times, so whether it drafts here would depend on the machine's load (its
    choices are tested in tests/scheduler/test_speculative.py)."""
    engine = Engine(config, InProcessLink(runner), tokenizer, frozenset({EOS_TOKEN_ID}),  # type: ignore[arg-type]
                    vocab_size=VOCAB, tracer=tracer)
    requests = mixed_requests(stop)
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
            collect_event(out, key, event)

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


def collect_event(out: Collected, key: int, event: StreamEvent) -> None:
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


def check_visibility(engine: Engine, trace: list[dict[str, Any]]) -> None:
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
