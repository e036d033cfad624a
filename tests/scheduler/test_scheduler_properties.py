"""Property test: random add / step / abort / finish / preempt / failed step against the fake worker.

After every operation: block manager and scheduler invariants, budget and
seats (checked by drive_step), and the worker's live sequences agree with
the scheduler's. At the end, with everything drained: no block leaked, and
every request not cut short finished by LENGTH with exactly the tokens of an
uncontended run (preemption, recompute and prefix-cache hits change nothing).
Prompts often start with one of a few shared prefixes, and configs run with
the prefix cache on or off.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.fake_worker import FakeWorker, drive_step, make_request, reference_output, wire_plan
from jitney.scheduler.core.block_manager import cdiv
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.request import FinishReason, Request
from jitney.scheduler.core.scheduler import Scheduler, SchedulerOutput

EOS = frozenset(range(0, 1000, 7))   # every request ignores it
PREFIXES = ((5, 6, 7, 8, 9, 10, 11, 12), (5, 6, 7, 8, 40, 41, 42, 43), (13, 14, 15, 16))


@dataclass(frozen=True)
class Add:
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int
    cache_salt: str = ""


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class Cut:
    index: int           # into the requests added so far
    abort: bool          # abort_request, else finish_request (a stop string)


@dataclass(frozen=True)
class Preempt:
    index: int           # into the running requests: force its preemption between steps


@dataclass(frozen=True)
class Fail:
    ran: bool            # the worker changed its state before it failed the step


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 16))
    max_num_seqs = draw(st.integers(1, 4))
    return SchedulerConfig(
        block_size=block_size,
        num_blocks=cdiv(max_model_len, block_size) + draw(st.integers(0, 4)),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, 12)),
        policy=draw(st.sampled_from(["continuous", "continuous", "static", "sequential"])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
    )


random_prompts = st.lists(st.integers(0, 999), min_size=1, max_size=12).map(tuple)
shared_prompts = st.builds(lambda prefix, n, tail: prefix[:n] + tail, st.sampled_from(PREFIXES),
                           st.integers(1, 8), st.lists(st.integers(0, 999), max_size=6).map(tuple))
adds = st.builds(Add, st.one_of(random_prompts, shared_prompts, shared_prompts),
                 st.integers(1, 10), st.integers(0, 2), st.sampled_from(["", "", "", "t"]))
operations = st.lists(st.one_of(
    adds, adds, st.just(Step()), st.just(Step()),
    st.builds(Cut, st.integers(0, 100), st.booleans()),
    st.builds(Preempt, st.integers(0, 100)),
    st.builds(Fail, st.booleans()),
), min_size=1, max_size=60)


class Harness:
    """Applies operations and checks the invariants after each."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.scheduler = Scheduler(config, eos_token_ids=EOS)
        self.worker = FakeWorker.for_config(config)
        self.requests: list[Request] = []
        self.cut: set[int] = set()

    def apply(self, op: Add | Step | Cut | Preempt | Fail) -> None:
        if isinstance(op, Add):
            self._add(op)
        elif isinstance(op, Preempt):
            self._preempt(op.index)
        elif isinstance(op, Fail):
            self._fail(op.ran)
        elif isinstance(op, Step):
            output, _ = drive_step(self.scheduler, self.worker)
            if output.preempted:
                event("preemption")
        elif self.requests:
            self._cut(self.requests[op.index % len(self.requests)], op.abort)
        self.check()

    def _preempt(self, index: int) -> None:
        """Preempt a running request as a full cache would (between steps)."""
        running = self.scheduler._running
        if running:
            victim = running[index % len(running)]
            self.scheduler._preempt(victim, SchedulerOutput(step_id=0))
            assert victim.block_ids == [] and victim.num_computed_tokens == 0
            event("forced preemption")

    def _fail(self, ran: bool) -> None:
        """The worker fails the next step (as the engine recovers): its
        requests end, every other running one is preempted, the next plan
        resets the worker."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return
        if ran:
            self.worker.execute(wire_plan(output))
        for chunk in output.scheduled:
            if self.scheduler.abort_request(chunk.request.seq_id, FinishReason.ABORTED) is not None:
                self.cut.add(chunk.request.seq_id)
        self.scheduler.block_manager.reset_prefix_cache()
        self.scheduler.recover_from_failed_step([output])
        assert self.scheduler.num_running == 0 and self.scheduler.block_manager.num_used_blocks == 0
        event("failed step")

    def _add(self, op: Add) -> None:
        limit = self.scheduler.config.max_model_len
        prompt = list(op.prompt[:limit - 1])
        max_tokens = min(op.max_tokens, limit - len(prompt))
        request = make_request(len(self.requests), prompt, max_tokens=max_tokens,
                               priority=op.priority, ignore_eos=True)
        request.cache_salt = op.cache_salt
        self.scheduler.add_request(request)
        self.requests.append(request)

    def _cut(self, request: Request, abort: bool) -> None:
        was_live = self.scheduler.get_request(request.seq_id) is not None
        if abort:
            got = self.scheduler.abort_request(request.seq_id, FinishReason.CANCELLED)
        else:
            got = self.scheduler.finish_request(request.seq_id, FinishReason.STOP_SEQUENCE)
        assert (got is request) == was_live
        if was_live:
            self.cut.add(request.seq_id)
            assert request.is_finished and request.block_ids == []

    def check(self) -> None:
        s = self.scheduler
        s.check_invariants()
        if not s._reset_worker:    # (else the next plan drops the worker's sequences)
            assert set(self.worker.seqs) == s._on_worker | set(s._pending_freed)

    def drain(self) -> None:
        for _ in range(2000):
            if not self.scheduler.has_work():
                break
            self.apply(Step())
        assert not self.scheduler.has_work(), "scheduler did not drain"
        assert self.scheduler.block_manager.num_used_blocks == 0
        assert self.worker.seqs == {} and self.worker.holders == {}
        if any(r.num_cached_tokens for r in self.requests):
            event("prefix-cache hit")
        for r in self.requests:
            assert r.is_finished
            if r.seq_id not in self.cut:
                assert r.finish_reason is FinishReason.LENGTH
                assert r.output_token_ids == reference_output(
                    r.prompt_token_ids, r.sampling.max_tokens)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), first=st.lists(adds, min_size=2, max_size=8), ops=operations)
def test_random_operations_keep_invariants_and_outputs(
        config: SchedulerConfig, first: list[Add], ops: list[Add | Step | Cut | Preempt | Fail]) -> None:
    harness = Harness(config)
    for op in [*first, *ops]:
        harness.apply(op)
    harness.drain()
    event(f"requests: {min(len(harness.requests), 10)}+" if harness.requests else "no requests")
