"""Planning step N+1 while step N runs (the engine's overlap), on the fake worker.

Decodes of step N+1 use the token step N is still sampling (a placeholder the
worker fills in); a request that finishes in step N is learnt of one step
late and its extra token is dropped. Outputs must equal an uncontended run.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.request import FinishReason
from jitney.scheduler.core.scheduler import Scheduler
from tests.support.fake_worker import FakeWorker, expected_token, make_request, reference_output, run_pipelined


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 16, seats: int = 8,
         max_model_len: int = 64, eos: frozenset[int] = frozenset(), prefix: bool = True):
    config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                             max_num_seqs=seats, max_num_batched_tokens=budget,
                             enable_prefix_caching=prefix)
    return Scheduler(config, eos_token_ids=eos), FakeWorker.for_config(config)


def test_pipelined_decodes_use_placeholders_and_match_reference() -> None:
    sched, worker = make()
    reqs = [make_request(i, [i * 7 % 50 + 1] * (3 + i), max_tokens=5 + i, ignore_eos=True) for i in range(1, 6)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_pipelined(sched, worker)
    assert any(c.last_token_from_sample for o in outputs for c in o.scheduled)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)
        assert r.finish_reason is FinishReason.LENGTH and r.num_pending_samples == 0
    assert sched.block_manager.num_used_blocks == 0


def test_length_finish_schedules_no_extra_step() -> None:
    """With max_tokens known, the last pending sample stops further decodes."""
    sched, worker = make()
    req = make_request(1, 5, max_tokens=3, ignore_eos=True)
    sched.add_request(req)
    outputs = run_pipelined(sched, worker)
    sampled = sum(c.sample for o in outputs for c in o.scheduled)
    assert sampled == 3 and req.num_output_tokens == 3


def test_eos_learnt_a_step_late_drops_the_extra_token() -> None:
    prompt = [3, 1, 4]
    first = expected_token(prompt)
    sched, worker = make(eos=frozenset({first}))
    req = make_request(1, prompt, max_tokens=10)
    sched.add_request(req)
    outputs = run_pipelined(sched, worker)
    assert req.output_token_ids == [first]
    assert req.finish_reason is FinishReason.END_OF_SEQUENCE
    # Step 2 was planned before step 1's EOS was known: it ran and was dropped.
    assert sum(c.sample for o in outputs for c in o.scheduled) == 2
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work()


def test_preemption_with_samples_in_flight_resumes_exactly() -> None:
    sched, worker = make(num_blocks=10, block_size=4, budget=12, seats=6, max_model_len=40)
    reqs = [make_request(i, [i + 2] * (4 + i), max_tokens=12, ignore_eos=True) for i in range(1, 6)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_pipelined(sched, worker)
    assert any(o.preempted for o in outputs)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 12)
    assert sched.block_manager.num_used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.booleans()), min_size=1, max_size=8),
       st.integers(6, 24), st.sampled_from([1, 2, 3]))
def test_random_pipelined_runs_match_reference(jobs, num_blocks, depth) -> None:
    sched, worker = make(num_blocks=num_blocks, block_size=4, budget=8, seats=4, max_model_len=24)
    reqs = []
    for i, (prompt_len, max_tokens, shared) in enumerate(jobs, 1):
        prompt = ([9] * 8 if shared else []) + [i] * prompt_len
        prompt = prompt[: 24 - max_tokens] or [i]
        reqs.append(make_request(i, prompt, max_tokens=max_tokens, ignore_eos=True))
        sched.add_request(reqs[-1])
    run_pipelined(sched, worker, depth=depth)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert sched.block_manager.num_used_blocks == 0
    sched.check_invariants()
