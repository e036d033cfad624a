"""--max-step-ms: the step-cost model's fit, and the scheduler's chunk sizing
under a step-time target, driven through the fake worker with step times
made from a known cost model (no clocks: the times are synthetic)."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.fake_worker import (FakeWorker, check_step_limits, make_request, reference_output,
                                       wire_plan)
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.request import Request
from jitney.scheduler.core.scheduler import PREFILL_SHARE, Scheduler, SchedulerOutput
from jitney.scheduler.core.step_cost import StepCostModel, chunk_keys

A, B, C = 0.002, 0.0001, 1e-6     # the fake model: 2 ms a step, 0.1 ms a token, 1 us a key


def true_seconds(tokens: int, keys: int) -> float:
    return A + B * tokens + C * keys


def output_keys(output: SchedulerOutput) -> int:
    return sum(chunk_keys(c.start_position, c.num_new_tokens) for c in output.scheduled)


# -- the fit -------------------------------------------------------------------

def _synthetic_steps(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(tokens, keys) of steps like a server's: decodes, plus sometimes a prefill chunk."""
    steps = []
    for _ in range(n):
        decodes, chunk, start = rng.randint(1, 64), rng.choice([0, 0, 16, 100, 300, 448]), rng.randint(0, 2500)
        steps.append((decodes + chunk, decodes * rng.randint(50, 600) + chunk_keys(start, chunk)))
    return steps


def test_fit_recovers_a_b_c_from_exact_step_times() -> None:
    model = StepCostModel()
    for tokens, keys in _synthetic_steps(random.Random(1), 64):
        model.observe(tokens, true_seconds(tokens, keys), keys)
    a, b, c = model.fit_with_keys()
    assert a == pytest.approx(A, rel=1e-3) and b == pytest.approx(B, rel=1e-3) and c == pytest.approx(C, rel=1e-3)
    assert model.predict(100, 5000) == pytest.approx(true_seconds(100, 5000), rel=1e-3)


def test_fit_is_robust_to_slow_outlier_steps() -> None:
    """3% noise, and every 8th step 20 ms late (another process took the core):
    the robust fit stays near the truth where plain least squares drifts."""
    rng = random.Random(2)
    model = StepCostModel()
    rows, times = [], []
    for i, (tokens, keys) in enumerate(_synthetic_steps(rng, 64)):
        t = true_seconds(tokens, keys) * (1 + rng.gauss(0, 0.03)) + (0.020 if i % 8 == 0 else 0.0)
        model.observe(tokens, t, keys)
        rows.append((1.0, tokens, keys))
        times.append(t)
    a, b, c = model.fit_with_keys()
    plain = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)[0]
    robust_error = abs(a - A) / A + abs(b - B) / B + abs(c - C) / C
    plain_error = abs(plain[0] - A) / A + abs(plain[1] - B) / B + abs(plain[2] - C) / C
    assert robust_error < plain_error
    assert b == pytest.approx(B, rel=0.1) and c == pytest.approx(C, rel=0.15)


def test_a_window_of_one_size_still_predicts_a_bigger_step() -> None:
    """Under a target the recent steps are all about one size (decodes and a cut chunk,
    5% noise, a fixed part most of their time): the slope per token is then the noise's.
    The steps kept per size class from earlier (four full 512-token chunks) hold it, so
    a 470-token chunk with 45 decodes is predicted within 20% in nearly every draw; the
    recent window alone (per_size=0) misses by more in many."""
    a, b, c = 0.06, 0.0005, 2e-8

    def seconds(tokens: int, keys: int) -> float:
        return a + b * tokens + c * keys

    query = (470 + 45, 45 * 300 + chunk_keys(0, 470))
    misses = {0: 0, 2: 0}
    for seed in range(20):
        rng = random.Random(seed)
        steps = [(512, chunk_keys(rng.randint(0, 300), 512)) for _ in range(4)]
        steps += [(d, d * rng.randint(280, 320)) for d in (rng.randint(45, 60) for _ in range(100))]
        timed = [(tokens, keys, seconds(tokens, keys) * (1 + rng.gauss(0, 0.05))) for tokens, keys in steps]
        for per_size in misses:
            model = StepCostModel(per_size=per_size)
            for tokens, keys, t in timed:
                model.observe(tokens, t, keys)
            misses[per_size] += abs(model.predict(*query) / seconds(*query) - 1) > 0.2
    assert misses[2] <= 2 and misses[0] >= 5, misses


def test_fit_keeps_coefficients_non_negative() -> None:
    model = StepCostModel()
    for tokens in range(1, 65, 4):     # time falls with keys: no physical model; c is held at 0
        model.observe(tokens, 0.001 + 0.0001 * tokens, 10_000 - tokens * 100)
    assert min(model.fit_with_keys()) >= 0.0


def test_prior_before_the_steps_tell() -> None:
    model = StepCostModel()
    assert not model.ready and model.fit_with_keys() == (1.0, 1.0 / 32, 0.0)
    model.observe(512, 0.15, chunk_keys(0, 512))
    assert not model.ready
    for _ in range(2):        # all the same size: only the two-term prior can split a from b
        model.observe(512, 0.15, chunk_keys(0, 512))
    assert model.ready
    a, b, c = model.fit_with_keys()
    assert (a, b) == pytest.approx(model.fit()) and c == pytest.approx(0.0, abs=1e-15)
    assert b == pytest.approx(0.15 / (512 + 32))
    assert model.predict(512, chunk_keys(0, 512)) == pytest.approx(0.15)
    assert model.predict(64, 64 * 300) < 0.15 / 2      # 64 decodes: the fixed part and 64 tokens' worth


def test_chunk_keys_by_hand() -> None:
    assert chunk_keys(0, 5) == 1 + 2 + 3 + 4 + 5
    assert chunk_keys(7, 1) == 8
    assert chunk_keys(3, 4) == 4 + 5 + 6 + 7
    assert chunk_keys(3, 4, window=5) == 4 + 5 + 5 + 5     # positions 3..6, at most 5 keys each
    assert chunk_keys(10, 3, window=4) == 3 * 4
    assert chunk_keys(0, 3, window=8) == chunk_keys(0, 3)


# -- the scheduler under a target ------------------------------------------------

def make(max_step_ms: float = 0.0, budget: int = 64) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(block_size=4, num_blocks=512, max_model_len=400, max_num_seqs=8,
                             max_num_batched_tokens=budget, max_step_ms=max_step_ms)
    return Scheduler(config), FakeWorker.for_config(config)


def workload() -> list[Request]:
    """Short requests decoding while long prompts arrive."""
    requests = [make_request(i, 6 + i, max_tokens=40) for i in range(1, 5)]
    requests += [make_request(10 + i, 300, max_tokens=8, arrival_time=100.0 + i) for i in range(3)]
    return requests


def drive(scheduler: Scheduler, worker: FakeWorker, requests: list[Request],
          times: Callable[[SchedulerOutput], float] = lambda o: true_seconds(o.num_batched_tokens, output_keys(o)),
          arrive_at: int = 10) -> list[tuple[SchedulerOutput, bool]]:
    """Every step until idle: each (plan, whether the cost model was ready when
    it was planned). The first 4 requests come at once, the rest at step
    ``arrive_at``; each step's "measured" time is ``times(plan)``."""
    for request in requests[:4]:
        scheduler.add_request(request)
    steps: list[tuple[SchedulerOutput, bool]] = []
    while scheduler.has_work() or len(steps) < arrive_at:
        assert len(steps) < 5000, "scheduler did not drain"
        if len(steps) == arrive_at:
            for request in requests[4:]:
                scheduler.add_request(request)
        ready = scheduler.step_cost.ready
        output = scheduler.schedule()
        check_step_limits(scheduler, output)
        scheduler.check_invariants()
        if output.is_empty:
            steps.append((output, ready))
            continue
        result = worker.execute(wire_plan(output))
        scheduler.observe_step_time(output, times(output))
        scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        scheduler.check_invariants()
        steps.append((output, ready))
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling.max_tokens)
    return steps


def decodes(output: SchedulerOutput) -> int:
    return sum(c.sample and c.num_new_tokens == 1 for c in output.scheduled)


def prefill_chunks(output: SchedulerOutput) -> list[int]:
    return [c.num_new_tokens for c in output.scheduled if not (c.sample and c.num_new_tokens == 1)]


def plans(steps: list[tuple[SchedulerOutput, bool]]) -> list[list[tuple[int, int, int]]]:
    return [[(c.request.seq_id, c.start_position, c.num_new_tokens) for c in o.scheduled] for o, _ in steps]


def test_target_keeps_predicted_steps_under_it_while_decodes_run() -> None:
    target_ms = 5.0
    scheduler, worker = make(target_ms)
    steps = drive(scheduler, worker, workload())
    cut = 0
    for output, ready in steps:
        if not ready or not decodes(output) or not prefill_chunks(output):
            continue
        assert output.predicted_seconds is not None
        if output.predicted_seconds > target_ms / 1000:
            # over only by the minimum chunk: one prefill chunk of one block (or what its prompt had left)
            (chunk,) = [c for c in output.scheduled if not (c.sample and c.num_new_tokens == 1)]
            assert chunk.num_new_tokens <= scheduler.config.min_prefill_chunk
        # the fake's times are the model's own: the fit is exact, so the real time is under it too
        assert true_seconds(output.num_batched_tokens, output_keys(output)) == pytest.approx(
            output.predicted_seconds, rel=1e-3)
        cut += output.num_batched_tokens < scheduler.config.max_num_batched_tokens
    assert cut > 10     # the long prompts were sized, not just let through
    # ... and off, the same long prompts rode with the decodes in steps far over the target.
    off = drive(*make(0.0), workload())
    assert max(true_seconds(o.num_batched_tokens, output_keys(o)) for o, _ in off if decodes(o)) > 2 * target_ms / 1000


def test_steps_without_decodes_fill_the_budget() -> None:
    scheduler, worker = make(5.0)
    for _ in range(4):       # a ready model that would cut a 64-token chunk (8.1 ms predicted)
        scheduler.step_cost.observe(64, true_seconds(64, chunk_keys(0, 64)), chunk_keys(0, 64))
        scheduler.step_cost.observe(8, true_seconds(8, chunk_keys(0, 8)), chunk_keys(0, 8))
    assert scheduler.step_cost.ready
    scheduler.add_request(make_request(1, 300, max_tokens=2))
    output = scheduler.schedule()
    assert [c.num_new_tokens for c in output.scheduled] == [64]
    assert output.predicted_seconds is not None and output.predicted_seconds > 0.005


def decode_seconds(output: SchedulerOutput) -> float:
    """The fake model's time of the step's decodes alone."""
    ds = [c for c in output.scheduled if c.sample and c.num_new_tokens == 1]
    return true_seconds(len(ds), sum(chunk_keys(c.start_position, 1) for c in ds))


def test_a_prefill_never_starves_under_a_target_no_step_can_meet() -> None:
    """0.001 ms: even the decodes alone are over it. A step's prefill still
    adds a quarter of the decodes' time (PREFILL_SHARE), at least one block,
    and everything finishes with the reference tokens (``drive`` checks them)."""
    scheduler, worker = make(0.001)
    steps = drive(scheduler, worker, workload())
    limited = [o for o, ready in steps if ready and decodes(o) and prefill_chunks(o)]
    assert limited
    for output in limited:
        assert output.predicted_seconds is not None
        within_share = output.predicted_seconds <= (1 + PREFILL_SHARE) * decode_seconds(output) * (1 + 1e-6)
        assert within_share or prefill_chunks(output) == [min(prefill_chunks(output)[0], scheduler.config.min_prefill_chunk)]
    # the share, not only the minimum chunk, carried the prompts: larger chunks rode too
    assert any(sum(prefill_chunks(o)) > scheduler.config.min_prefill_chunk for o in limited)


def test_off_plans_as_without_the_flag() -> None:
    """Off (0), the cost model is measured but never sizes a chunk: the plans
    equal those of a scheduler whose model saw no step; a target no step
    reaches cuts nothing either."""
    reference = plans(drive(*make(0.0), workload(), times=lambda o: 0.0))   # 0 s: never observed
    off = plans(drive(*make(0.0), workload()))
    huge = plans(drive(*make(1e9), workload()))
    assert off == reference and huge == reference


def test_config_and_flag_validate_max_step_ms() -> None:
    for bad in (-1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="max_step_ms must be a finite number >= 0"):
            SchedulerConfig(block_size=4, num_blocks=64, max_model_len=64, max_step_ms=bad)  # type: ignore[arg-type]
    from jitney.scheduler.main import SchedulerProcessConfig, add_scheduler_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_scheduler_arguments(parser)
    assert parser.parse_args([]).max_step_ms == 0.0
    ns = parser.parse_args(["--max-step-ms", "60"])
    assert SchedulerProcessConfig.from_namespace(ns).max_step_ms == 60.0
    with pytest.raises(argparse.ArgumentError, match="must be a finite number >= 0"):
        parser.parse_args(["--max-step-ms", "-5"])


def test_two_plans_in_flight_under_a_target() -> None:
    """As the engine runs it: step N + 1 planned before N's result (its decodes
    ride with placeholder tokens, and N's time is not in yet). Steps stay
    under the target or at the minimum chunk, and the tokens are the reference's."""
    target_ms = 5.0
    scheduler, worker = make(target_ms)
    requests = workload()
    for request in requests:
        scheduler.add_request(request)
    in_flight: list[tuple[SchedulerOutput, engine_pb2.StepResult]] = []
    planned: list[SchedulerOutput] = []
    while scheduler.has_work() or in_flight:
        assert len(planned) < 5000, "scheduler did not drain"
        if len(in_flight) < 2:
            output = scheduler.schedule()
            check_step_limits(scheduler, output)
            if not output.is_empty:
                in_flight.append((output, worker.execute(wire_plan(output))))
                planned.append(output)
                continue
        output, result = in_flight.pop(0)
        scheduler.observe_step_time(output, true_seconds(output.num_batched_tokens, output_keys(output)))
        scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        scheduler.check_invariants()
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling.max_tokens)
    sized = [o for o in planned[4:] if decodes(o) and prefill_chunks(o)]
    assert sized
    for output in sized:
        assert output.predicted_seconds is not None
        assert (output.predicted_seconds <= target_ms / 1000
                or prefill_chunks(output) == [min(prefill_chunks(output)[0], scheduler.config.min_prefill_chunk)])


def test_trace_records_the_prediction_beside_the_measured_time(tmp_path: Path) -> None:
    from jitney.scheduler.core.trace import StepTracer, read_trace

    for target in (0.0, 5.0):
        scheduler, worker = make(target)
        tracer = StepTracer(tmp_path / f"{target}.jsonl")
        for request in workload()[:4]:
            scheduler.add_request(request)
        for _ in range(6):
            output = scheduler.schedule()
            started = tracer.now()
            result = worker.execute(wire_plan(output))
            measured = true_seconds(output.num_batched_tokens, output_keys(output))
            expected = output.predicted_seconds if target else (
                scheduler.predict_step(output) if scheduler.step_cost.num_observed else None)
            tracer.record(output, started, measured, measured, scheduler)
            scheduler.observe_step_time(output, measured)
            scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        tracer.close()
        lines = read_trace(tmp_path / f"{target}.jsonl")
        assert lines[0]["predicted_s"] is None     # nothing measured yet
        assert all(line["predicted_s"] is not None for line in lines[3:])
        assert lines[-1]["predicted_s"] == pytest.approx(expected, abs=1e-6)
        assert lines[-1]["predicted_s"] == pytest.approx(lines[-1]["model_s"], rel=1e-2)


def test_bench_step_stats_from_a_trace() -> None:
    """bench/step_time.py's trace summary, by hand: steps with decodes, over the
    target, and the prediction's error (relative to the measured time)."""
    from bench.step_time import step_stats

    trace: list[dict[str, Any]] = [
        {"decode_tokens": 0, "model_s": 0.100, "predicted_s": None},
        {"decode_tokens": 4, "model_s": 0.050, "predicted_s": 0.055},   # +10%
        {"decode_tokens": 4, "model_s": 0.080, "predicted_s": 0.060},   # -25%
        {"decode_tokens": 8, "model_s": 0.040, "predicted_s": 0.040},   # 0
    ]
    stats = step_stats(trace, target_ms=60)
    assert (stats["steps"], stats["steps_with_decodes"], stats["predicted_steps"]) == (4, 3, 3)
    assert stats["decode_steps_over_target"] == 1
    assert stats["decode_step_model_ms"] == {"p50": 50.0, "p99": 80.0, "max": 80.0}
    assert stats["prediction_error"]["median"] == pytest.approx(0.1)
    assert stats["prediction_error"]["p90"] == pytest.approx(0.25)
    assert stats["prediction_error"]["mean_signed"] == pytest.approx(round((0.1 - 0.25 + 0) / 3, 3))
    assert "decode_steps_over_target" not in step_stats(trace, target_ms=0)
