"""Prefix caching in the scheduler, driven through the fake worker.

The fake worker samples from the whole history read back through the block
table, so a wrong hit (stale or foreign blocks) changes the output tokens,
and it refuses any write into a block another live sequence holds.
"""

from __future__ import annotations

from tests.support.fake_worker import FakeWorker, drive_step, make_request, reference_output, run_until_idle
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.request import FinishReason, Request
from jitney.scheduler.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

SYSTEM = [(7 * i) % 97 + 3 for i in range(13)]      # a shared 13-token "system prompt"


def make(prefix_caching: bool = True, block_size: int = 4, num_blocks: int = 64,
         max_model_len: int = 64, max_num_seqs: int = 8,
         max_num_batched_tokens: int = 32) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks,
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=prefix_caching)
    return Scheduler(config), FakeWorker(num_blocks, block_size)


def chunk_of(output: SchedulerOutput, request: Request) -> ScheduledChunk | None:
    return next((c for c in output.scheduled if c.request is request), None)


def assert_all_idle(s: Scheduler, w: FakeWorker) -> None:
    bm = s.block_manager
    assert not s.has_work() and w.seqs == {} and w.holders == {}
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    bm.check_invariants()


def run_waves(prefix_caching: bool, waves: list[list[tuple[list[int], int]]],
              **config: int) -> tuple[list[Request], int, Scheduler]:
    """Add each wave of (prompt, max_tokens) after two steps of the previous
    one; return the requests, the tokens computed, and the scheduler."""
    s, w = make(prefix_caching, **config)
    requests: list[Request] = []
    computed = 0
    for wave in waves:
        for prompt, max_tokens in wave:
            r = make_request(len(requests) + 1, prompt, max_tokens=max_tokens, ignore_eos=True)
            s.add_request(r)
            requests.append(r)
        for _ in range(2):
            if s.has_work():
                computed += drive_step(s, w)[0].num_batched_tokens
    computed += sum(o.num_batched_tokens for o in run_until_idle(s, w))
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_all_idle(s, w)
    return requests, computed, s


def shared_prefix_waves() -> list[list[tuple[list[int], int]]]:
    return [[(SYSTEM + [200 + 10 * w + i] * (1 + i), 3 + (i + w) % 5) for i in range(4)]
            for w in range(4)]


def test_outputs_identical_with_cache_on_and_off_on_concurrent_shared_prefixes() -> None:
    on, computed_on, s_on = run_waves(True, shared_prefix_waves())
    off, computed_off, s_off = run_waves(False, shared_prefix_waves())
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    assert computed_on < computed_off
    assert all(r.num_cached_tokens == 0 for r in off)
    assert all(r.num_cached_tokens == 12 for r in on[4:])      # 3 blocks of SYSTEM
    bm = s_on.block_manager
    assert bm.prefix_cache_hit_tokens >= 12 * 12
    assert bm.prefix_cache_queried_tokens == sum(r.num_prompt_tokens for r in on)
    assert s_off.block_manager.prefix_cache_queried_tokens == 0


def test_outputs_identical_under_forced_preemption_in_a_tiny_cache() -> None:
    waves = [[(SYSTEM[:5] + [300 + 7 * w + i], 6) for i in range(3)] for w in range(3)]
    tiny = dict(block_size=2, num_blocks=10, max_model_len=20, max_num_seqs=4,
                max_num_batched_tokens=8)
    on, _, _ = run_waves(True, waves, **tiny)
    off, _, _ = run_waves(False, waves, **tiny)
    assert sum(r.num_preemptions for r in on) > 0 and sum(r.num_preemptions for r in off) > 0
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    assert any(r.num_cached_tokens > 0 for r in on)


def test_first_chunk_starts_past_the_hit_and_sends_the_whole_table() -> None:
    s, w = make()
    a = make_request(1, 10, max_tokens=2)
    s.add_request(a)
    run_until_idle(s, w)                                 # blocks 0, 1 cached; 2 plain
    b = make_request(2, list(range(1, 9)) + [20, 21], max_tokens=2)
    s.add_request(b)
    out, _ = drive_step(s, w)
    c = chunk_of(out, b)
    assert out.new_seqs == [b] and c is not None
    assert (c.start_position, c.token_ids, c.new_block_ids) == (8, [20, 21], [0, 1, 3])
    assert b.num_cached_tokens == 8 and out.num_batched_tokens == 2
    run_until_idle(s, w)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)
    assert_all_idle(s, w)


def test_an_identical_prompt_recomputes_its_last_block() -> None:
    s, w = make()
    a = make_request(1, 8, max_tokens=1)
    s.add_request(a)
    run_until_idle(s, w)
    b = make_request(2, 8, max_tokens=3)
    s.add_request(b)
    out, _ = drive_step(s, w)
    c = chunk_of(out, b)
    assert c is not None and (c.start_position, c.num_new_tokens, c.sample) == (4, 4, True)
    run_until_idle(s, w)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 3)


def test_a_block_is_shared_only_from_the_step_after_it_is_filled() -> None:
    s, w = make()
    a, b = make_request(1, 9, max_tokens=4), make_request(2, 9, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    drive_step(s, w)                                     # both board in one step
    assert (a.block_ids, b.block_ids, b.num_cached_tokens) == ([0, 1, 2], [3, 4, 5], 0)
    c = make_request(3, 9, max_tokens=4)
    s.add_request(c)
    drive_step(s, w)
    assert c.block_ids == [0, 1, 6] and c.num_cached_tokens == 8
    assert [s.block_manager.ref_count(i) for i in range(7)] == [2, 2, 1, 1, 1, 1, 1]
    run_until_idle(s, w)
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids
    assert_all_idle(s, w)


def test_cancelling_one_sharer_leaves_the_others_correct() -> None:
    s, w = make()
    a = make_request(1, SYSTEM, max_tokens=2)
    s.add_request(a)
    run_until_idle(s, w)
    riders = [make_request(i, SYSTEM + [i], max_tokens=6, ignore_eos=True) for i in (2, 3, 4)]
    for r in riders:
        s.add_request(r)
    drive_step(s, w)
    drive_step(s, w)
    assert s.block_manager.ref_count(riders[0].block_ids[0]) == 3
    s.abort_request(3, FinishReason.CANCELLED)
    assert s.block_manager.ref_count(riders[0].block_ids[0]) == 2
    run_until_idle(s, w)
    for r in (riders[0], riders[2]):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 6)
    assert_all_idle(s, w)


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    s, w = make(block_size=2, num_blocks=6, max_model_len=12, max_num_seqs=2,
                max_num_batched_tokens=12)
    a = make_request(1, [1, 2, 3, 4, 5], max_tokens=5, ignore_eos=True)
    b = make_request(2, [9, 8, 7, 6, 5], max_tokens=5, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    resumed = None
    while s.has_work():
        out, _ = drive_step(s, w)
        if b in out.new_seqs and b.num_preemptions:
            resumed = chunk_of(out, b)
    assert resumed is not None and resumed.start_position > 0
    assert b.num_cached_tokens == 0                      # usage counts the first boarding
    for r in (a, b):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 5)
    assert_all_idle(s, w)


def test_different_salts_do_not_share() -> None:
    s, w = make()
    a = make_request(1, 9, max_tokens=1)
    a.cache_salt = "tenant-a"
    s.add_request(a)
    run_until_idle(s, w)
    b = make_request(2, 9, max_tokens=1)
    b.cache_salt = "tenant-b"
    s.add_request(b)
    c = make_request(3, 9, max_tokens=1)
    c.cache_salt = "tenant-a"
    s.add_request(c)
    run_until_idle(s, w)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 8)
