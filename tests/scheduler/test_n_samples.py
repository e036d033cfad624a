"""n > 1: one prompt, n samples; the prompt is computed once and its blocks shared.

Driven through the fake worker (tests/support/fake_worker.py), which runs every plan
through the real worker's checks and reads every token back through the
block tables: a sibling that read a block its parent had not written, or
wrote into a shared block, would change its output or raise.
"""

from __future__ import annotations

from dataclasses import replace

from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.plan import sample_seed, to_step_plan
from jitney.scheduler.core.request import FinishReason, Request, RequestStatus
from jitney.scheduler.core.scheduler import Scheduler
from tests.support.fake_worker import FakeWorker, drive_step, make_request, reference_output, run_pipelined

BLOCK = 16


def config(num_blocks: int = 256, budget: int = 512, prefix: bool = True) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, block_size=BLOCK,
                           num_blocks=num_blocks, max_model_len=min(2048, num_blocks * BLOCK),
                           enable_prefix_caching=prefix)


def samples(first_id: int, prompt: int, n: int, max_tokens: int = 8) -> list[Request]:
    """A request's n samples as the engine makes them: 1.. have sample 0 as parent."""
    parent = make_request(first_id, prompt, max_tokens=max_tokens, ignore_eos=True)
    out = [parent]
    for i in range(1, n):
        child = make_request(first_id + i, prompt, max_tokens=max_tokens, ignore_eos=True,
                             arrival_time=parent.arrival_time)
        child.parent, child.sample_index = parent, i
        out.append(child)
    return out


def run(sched: Scheduler, worker: FakeWorker) -> tuple[int, dict[int, int], int]:
    """Drive to idle; (peak blocks in use, prompt tokens computed per seq, steps)."""
    peak, prompt_work, steps = 0, {}, 0
    while sched.has_work():
        output, _ = drive_step(sched, worker)
        sched.check_invariants()
        steps += 1
        peak = max(peak, sched.block_manager.num_used_blocks)
        for c in output.scheduled:
            p = c.request.num_prompt_tokens
            computed = max(0, min(c.start_position + c.num_new_tokens, p) - c.start_position)
            prompt_work[c.request.seq_id] = prompt_work.get(c.request.seq_id, 0) + computed
    return peak, prompt_work, steps


def test_prompt_computed_once_and_blocks_shared() -> None:
    """The issue's target: n = 4 on a 512-token prompt holds <= 1.3x the blocks
    of n = 1, and the prompt is computed once (each sibling recomputes only
    its last block, to have logits of its own)."""
    peaks = {}
    for n in (1, 4):
        sched = Scheduler(config(prefix=False))   # sharing does not rely on the prefix cache
        worker = FakeWorker.for_config(sched.config)
        reqs = samples(1, 512, n)
        for r in reqs:
            sched.add_request(r)
        peaks[n], work, _ = run(sched, worker)
        assert work[1] == 512
        for r in reqs[1:]:
            assert work[r.seq_id] == BLOCK      # (512 - 1) // 16 = 31 blocks shared, the 32nd computed
        for r in reqs:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, 8)
            assert r.finish_reason is FinishReason.LENGTH
        assert sched.block_manager.num_used_blocks == 0
        assert sched.block_manager.prefix_cache_hit_tokens == 0   # sharing is not a cache hit
    assert peaks[4] <= 1.3 * peaks[1], peaks


def test_siblings_wait_for_the_parents_whole_prompt() -> None:
    """With a chunked prompt, no sibling boards before the step after the
    parent's last prompt chunk (the worker has written every shared block)."""
    sched = Scheduler(config(budget=64))
    worker = FakeWorker.for_config(sched.config)
    reqs = samples(1, 200, 3, max_tokens=4)
    for r in reqs:
        sched.add_request(r)
    parent_done_step = None
    step = 0
    while sched.has_work():
        output, _ = drive_step(sched, worker)
        step += 1
        ids = {c.request.seq_id for c in output.scheduled}
        if parent_done_step is None:
            assert ids <= {1}, f"step {step}: a sibling rode during the parent's prefill"
            if reqs[0].num_computed_tokens >= 200:
                parent_done_step = step
        sched.check_invariants()
    assert parent_done_step is not None
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 4)


def test_held_siblings_count_as_waiting_and_abort_cleanly() -> None:
    sched = Scheduler(config(budget=64))
    worker = FakeWorker.for_config(sched.config)
    reqs = samples(1, 300, 4)
    for r in reqs:
        sched.add_request(r)
    assert sched.num_waiting == 4
    drive_step(sched, worker)
    assert sched.num_running == 1 and sched.num_waiting == 3
    for r in reqs:     # cancel the whole request while its siblings are held
        sched.abort_request(r.seq_id, FinishReason.CANCELLED)
    sched.check_invariants()
    assert not sched.has_work() or sched.schedule().scheduled == []
    assert sched.block_manager.num_used_blocks == 0
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


def test_parent_gone_releases_siblings() -> None:
    """A parent that ends early (cancelled, stop string) does not strand its
    siblings: they compute the prompt themselves (here from the prefix cache)."""
    sched = Scheduler(config(budget=64))
    worker = FakeWorker.for_config(sched.config)
    reqs = samples(1, 100, 3, max_tokens=4)
    for r in reqs:
        sched.add_request(r)
    drive_step(sched, worker)
    sched.abort_request(1, FinishReason.CANCELLED)
    run(sched, worker)
    for r in reqs[1:]:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 4)
    assert sched.block_manager.num_used_blocks == 0


def test_preemption_and_pipelining_with_samples() -> None:
    """Tight cache: samples are preempted and recomputed, plans overlap; every
    sample still gets the reference output and every block comes back."""
    sched = Scheduler(config(num_blocks=24, budget=96))
    worker = FakeWorker.for_config(sched.config)
    reqs = samples(1, 150, 4, max_tokens=80) + samples(10, 90, 3, max_tokens=60)
    for r in reqs:
        sched.add_request(r)
    run_pipelined(sched, worker)
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert sched.block_manager.num_used_blocks == 0


def test_sample_seeds() -> None:
    """Sample 0 keeps the request's seed; the others get distinct, reproducible ones."""
    seeds = [sample_seed(1234, i) for i in range(16)]
    assert seeds[0] == 1234
    assert len(set(seeds)) == 16
    assert seeds == [sample_seed(1234, i) for i in range(16)]
    assert all(0 <= s < 2**64 for s in seeds)
    assert sample_seed(1235, 1) != seeds[1]


def test_plan_carries_the_new_sampling_fields() -> None:
    """Every SamplingOptions field the worker needs reaches its SamplingConfig;
    min_tokens bans EOS (unless ignore_eos) and the stop ids."""
    sched = Scheduler(config())
    req = make_request(1, 20, max_tokens=8, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=-0.5, logit_bias=((3, 2.0), (7, -100.0)), min_tokens=4,
                       stop_token_ids=frozenset({9}), top_logprobs=5, prompt_logprobs=2)
    sched.add_request(req)
    plan = to_step_plan(sched.schedule(), frozenset({2}), masked=lambda r: True)
    cfg = plan.new_sequences[0].sampling
    assert abs(cfg.min_p - 0.1) < 1e-7 and abs(cfg.repetition_penalty - 1.3) < 1e-6
    assert cfg.presence_penalty == 0.5 and cfg.frequency_penalty == -0.5
    assert list(cfg.logit_bias_ids) == [3, 7] and list(cfg.logit_bias_values) == [2.0, -100.0]
    assert cfg.min_tokens == 4 and sorted(cfg.min_tokens_banned_ids) == [2, 9]
    assert cfg.top_logprobs == 5 and cfg.HasField("prompt_logprobs") and cfg.prompt_logprobs == 2
    assert cfg.num_prompt_tokens == 20
    assert plan.chunks[0].masked    # it samples, and the request is constrained
    req.prompt_logprobs_done = True   # a later pass (after preemption) does not ask again
    again = make_request(2, 20, max_tokens=8, ignore_eos=True, min_tokens=2, prompt_logprobs=0)
    again.prompt_logprobs_done = True
    sched.add_request(again)
    plan = to_step_plan(sched.schedule(), frozenset({2}))
    cfg = plan.new_sequences[0].sampling
    assert not cfg.HasField("prompt_logprobs") and list(cfg.min_tokens_banned_ids) == []


def test_prompt_logprobs_request_reads_no_cached_prefix() -> None:
    sched = Scheduler(config())
    worker = FakeWorker.for_config(sched.config)
    first = make_request(1, 64, max_tokens=2, ignore_eos=True)
    sched.add_request(first)
    run(sched, worker)
    wants = make_request(2, 64, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    plain = make_request(3, 64, max_tokens=2, ignore_eos=True)
    sched.add_request(wants)
    sched.add_request(plain)
    out = sched.schedule()
    starts = {c.request.seq_id: c.start_position for c in out.scheduled}
    assert starts[2] == 0 and starts[3] == 48


def test_penalised_sequences_get_the_context_they_do_not_compute() -> None:
    """A penalised sample that shares its parent's blocks, or a penalised
    request that hits the prefix cache, tells the worker the skipped tokens
    (context_token_ids) so its penalty counts cover them; others send none."""
    sched = Scheduler(config(budget=512))
    worker = FakeWorker.for_config(sched.config)
    reqs = samples(1, 100, 2, max_tokens=4)
    for r in reqs:
        r.sampling = replace(r.sampling, frequency_penalty=0.5)
    plain = make_request(5, 100, max_tokens=4, ignore_eos=True)   # same prompt, no penalty: a cache hit
    hit = make_request(6, 100, max_tokens=4, ignore_eos=True, repetition_penalty=1.2)
    for r in reqs:
        sched.add_request(r)
    contexts: dict[int, list[int]] = {}
    for step in range(100):
        if step == 1:      # the parent's prompt blocks are cached from step 2 on
            sched.add_request(plain)
            sched.add_request(hit)
        if step and not sched.has_work():
            break
        output = sched.schedule()
        plan = to_step_plan(output)
        for new in plan.new_sequences:
            contexts[new.seq_id] = list(new.context_token_ids)
        if not output.is_empty:
            result = worker.execute(plan)
            sched.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
    prompt = reqs[0].prompt_token_ids
    assert contexts[1] == [] and contexts[5] == []          # from 0; no penalty
    assert contexts[2] == prompt[:96]                       # shared: (100 - 1) // 16 blocks
    assert contexts[6] == prompt[:96]                       # a prefix-cache hit
