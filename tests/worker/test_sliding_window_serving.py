"""Sliding windows served end to end in one process: the real Scheduler plans,
the real ModelRunner runs the plans (through the wire encoding), on tiny
random models whose windows are shorter than the prompts.

- A Mistral (every layer windowed): a long request holds a bounded number
  of blocks, and a request that hits the prefix cache (its table starts with
  null entries) gives the same token ids and logprob bits as with no cache.
- A Gemma 3 (sliding and global layers interleaved): nothing can be
  released, and a prefix hit gives the same bits too.
Both under chunked prefill (a step budget of 8 tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig, max_model_len_for
from jitney.scheduler.core.plan import to_step_plan
from jitney.scheduler.core.request import Request
from jitney.scheduler.core.scheduler import Scheduler
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner
from tests.support.fake_worker import make_request
from tests.support.tiny_models import make_tiny_gemma, make_tiny_mistral

BLOCK, BUDGET = 4, 8
PREFIX = [(7 * i) % 311 + 3 for i in range(41)]


def serve(runner: ModelRunner, cache: bool) -> Scheduler:
    ready = runner.ready_message()
    config = SchedulerConfig(
        block_size=ready.block_size, num_blocks=ready.num_blocks, max_num_seqs=4, max_num_batched_tokens=BUDGET,
        max_model_len=max_model_len_for(ready.context_length, ready.num_blocks, ready.block_size,
                                        ready.sliding_window, BUDGET),
        sliding_window=ready.sliding_window, enable_prefix_caching=cache)
    return Scheduler(config)


def run(runner: ModelRunner, sched: Scheduler, requests: list[Request]) -> int:
    """Drive to idle; returns the most blocks in use at once."""
    for r in requests:
        sched.add_request(r)
    peak = 0
    while sched.has_work():
        output = sched.schedule()
        sched.check_invariants()
        peak = max(peak, sched.block_manager.num_used_blocks)
        plan = engine_pb2.StepPlan.FromString(to_step_plan(output).SerializeToString())
        result = runner.execute(plan)
        sched.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
    assert sched.block_manager.num_used_blocks == 0
    sched.block_manager.check_invariants()
    return peak


def hit_and_miss(path: Path) -> dict[bool, list[Request]]:
    """The same two requests, the second sharing the first's 41-token prefix,
    with and without the prefix cache (one fresh runner each)."""
    out = {}
    for cache in (True, False):
        runner = ModelRunner(WorkerConfig(model=str(path), dtype="float32", block_size=BLOCK, num_blocks=64,
                                          max_num_batched_tokens=BUDGET, max_num_seqs=4, use_weights_cache=False))
        sched = serve(runner, cache)
        first = make_request(1, PREFIX + [9], max_tokens=6, ignore_eos=True)
        run(runner, sched, [first])
        second = make_request(2, PREFIX + [17, 5], max_tokens=6, ignore_eos=True)
        run(runner, sched, [second])
        out[cache] = [first, second]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windows")
    return {"mistral": make_tiny_mistral(root / "mistral", window=7),
            "gemma3": make_tiny_gemma(root / "gemma3", version=3, window=5)}


@pytest.mark.parametrize("name,window,hit", [("mistral", 7, 40), ("gemma3", 0, 40)])
def test_a_prefix_hit_gives_the_same_bits_as_no_hit(models: dict[str, Path], name: str, window: int,
                                                   hit: int) -> None:
    out = hit_and_miss(models[name])
    cached, plain = out[True], out[False]
    assert cached[1].num_cached_tokens == hit and plain[1].num_cached_tokens == 0
    for a, b in zip(cached, plain):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == b.output_logprobs      # float equality: the same bits


def test_a_long_windowed_request_holds_few_blocks(models: dict[str, Path]) -> None:
    runner = ModelRunner(WorkerConfig(model=str(models["mistral"]), dtype="float32", block_size=BLOCK,
                                      num_blocks=12, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                                      use_weights_cache=False))
    assert runner.ready_message().sliding_window == 7
    sched = serve(runner, cache=True)
    assert sched.config.max_model_len == 256     # 11 blocks serve the whole context
    long = make_request(1, [(5 * i) % 300 + 3 for i in range(150)], max_tokens=40, ignore_eos=True)
    peak = run(runner, sched, [long])
    assert len(long.output_token_ids) == 40
    assert peak == 4      # the bound blocks_per_sequence is 5; 190 tokens without a window: 48 blocks
