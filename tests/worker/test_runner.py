"""ModelRunner driven by engine_pb2 step plans, as the scheduler drives it."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import make_tiny_llama
from tests.support.engine_sockets import SchedulerSockets
from tests.support.runner_driver import BLOCK, NUM_BLOCKS, PROMPTS, Driver, outputs
from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.config import WorkerConfig
from jitney.worker.main import run_worker
from jitney.worker.runner.plan_checks import PlanError
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.runner.device import STEP_DEFAULTS, resolve_batch_invariant, use_cpu_attention
from jitney.worker.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("runner") / "tiny")


@pytest.fixture(scope="module")
def config(model_dir: Path) -> WorkerConfig:
    return WorkerConfig(
        model=str(model_dir), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=64, max_num_seqs=8,
    )


@pytest.fixture
def runner(config: WorkerConfig) -> ModelRunner:
    return ModelRunner(config)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_equals_alone(config: WorkerConfig, temperature: float) -> None:
    together = Driver(ModelRunner(config))
    for sid in (1, 2):
        together.add(sid, PROMPTS[sid], temperature, seed=sid)
    together.generate([1, 2], steps=9)
    for sid in (1, 2):
        alone = Driver(ModelRunner(config))
        alone.add(sid, PROMPTS[sid], temperature, seed=sid)
        alone.generate([sid], steps=9)
        assert outputs(alone, sid) == outputs(together, sid)
        assert len(outputs(alone, sid)) == 9


def test_chunked_prefill_equals_one_shot(runner: ModelRunner, config: WorkerConfig) -> None:
    chunked = Driver(runner)
    chunked.add(3, PROMPTS[3])
    for _ in range(5):  # 23 prompt tokens in chunks of 5: the 5th step samples
        chunked.step({3: 5})
    chunked.generate([3], steps=6)
    one_shot = Driver(ModelRunner(config))
    one_shot.add(3, PROMPTS[3])
    one_shot.generate([3], steps=7)
    assert outputs(chunked, 3) == outputs(one_shot, 3) and len(outputs(chunked, 3)) == 7


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preempted_sequence_recomputes_the_same_tokens(config: WorkerConfig, temperature: float) -> None:
    steady = Driver(ModelRunner(config))
    steady.add(1, PROMPTS[1], temperature, seed=7)
    steady.generate([1], steps=10)
    bumpy = Driver(ModelRunner(config))
    bumpy.add(1, PROMPTS[1], temperature, seed=7)
    bumpy.add(2, PROMPTS[2])
    bumpy.generate([1, 2], steps=4)
    bumpy.preempt(1)  # freed and re-added in the same plan, new blocks
    bumpy.step({1: 9, 2: 1}, freed=(1,))  # recompute in two chunks
    bumpy.generate([1], steps=6)
    assert outputs(bumpy, 1) == outputs(steady, 1)


def test_a_plan_that_only_frees(runner: ModelRunner) -> None:
    driver = Driver(runner)
    driver.add(1, PROMPTS[1])
    driver.generate([1], steps=1)
    result = runner.execute(pb.StepPlan(step_id=50, freed_seq_ids=[1]))
    assert result.step_id == 50 and not result.seq_ids and 1 not in runner.sequences


def test_results_follow_the_plans_order(runner: ModelRunner) -> None:
    """The step runs decodes first, but the result lists samples in plan order."""
    alone = runner.execute(pb.StepPlan(step_id=1, new_sequences=[pb.NewSequence(seq_id=1)], chunks=[
        pb.ScheduledChunk(seq_id=1, start_position=0, token_ids=[5, 6, 7], new_block_ids=[0], sample=True)]))
    plan = pb.StepPlan(step_id=2, new_sequences=[pb.NewSequence(seq_id=2), pb.NewSequence(seq_id=3)], chunks=[
        pb.ScheduledChunk(seq_id=2, start_position=0, token_ids=[9, 10, 11, 12, 13], new_block_ids=[1, 2],
                          sample=True),
        pb.ScheduledChunk(seq_id=1, start_position=3, last_token_from_sample=True, sample=True),
        pb.ScheduledChunk(seq_id=3, start_position=0, token_ids=[14, 15], new_block_ids=[3], sample=False),
    ])
    result = runner.execute(plan)
    assert list(alone.seq_ids) == [1] and list(result.seq_ids) == [2, 1]
    assert len(result.token_ids) == len(result.logprobs) == 2


def test_live_sequences_beyond_the_seats_are_refused(runner: ModelRunner, config: WorkerConfig) -> None:
    seats = config.max_num_seqs
    assert seats is not None
    plan = pb.StepPlan(step_id=7, new_sequences=[pb.NewSequence(seq_id=100 + i) for i in range(seats + 1)])
    with pytest.raises(PlanError, match="exceed max_num_seqs"):
        runner.execute(plan)
    assert runner.sequences == {}


def test_ready_reports_the_step_limits_and_warm_up(runner: ModelRunner, config: WorkerConfig) -> None:
    ready = runner.ready_message()
    assert (ready.max_num_seqs, ready.max_num_batched_tokens) == (config.max_num_seqs, config.max_num_batched_tokens)
    assert ready.warmup_seconds > 0
    assert runner.sequences == {} and runner.batch.rows == {}  # the warm-up's sequences are gone


def test_device_defaults_fill_unset_step_limits(model_dir: Path) -> None:
    runner = ModelRunner(WorkerConfig(model=str(model_dir), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS))
    assert (runner.limits.max_num_batched_tokens, runner.limits.max_num_seqs) == STEP_DEFAULTS["cpu"]


def test_batch_invariance_defaults_and_refusals(caplog: pytest.LogCaptureFixture) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_batch_invariant(WorkerConfig(), cpu, torch.bfloat16)
    assert resolve_batch_invariant(WorkerConfig(), cpu, torch.float32)
    assert not resolve_batch_invariant(WorkerConfig(), cuda, torch.bfloat16)   # until measured on a GPU
    assert resolve_batch_invariant(WorkerConfig(batch_invariant=True), cuda, torch.bfloat16)
    assert not resolve_batch_invariant(WorkerConfig(batch_invariant=False), cpu, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="jitney.worker"):
        assert not resolve_batch_invariant(WorkerConfig(), cpu, torch.float16)
    assert "not batch-invariant" in caplog.text
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        resolve_batch_invariant(WorkerConfig(batch_invariant=True), cpu, torch.float16)


def test_cpu_attention_names_the_form_the_worker_runs(model_dir: Path) -> None:
    """--cpu-attention: the worker's attention runs the named form; a name outside the
    choices, or a named form where the CPU kernels do not run, is refused before loading."""
    fastest = cpu_kernels.attention_kernel()
    try:
        ModelRunner(WorkerConfig(model=str(model_dir), dtype="bfloat16", block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                 cpu_attention="portable"))
        assert cpu_kernels.attention_kernel() == "portable"
    finally:
        cpu_kernels.set_attention_kernel("auto")
    assert cpu_kernels.attention_kernel() == fastest
    with pytest.raises(ValueError, match="cpu_attention must be one of"):
        WorkerConfig(cpu_attention="fast")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        WorkerConfig(device="cuda", cpu_attention="avx512")
    with pytest.raises(ValueError, match="needs the CPU's batch-invariant kernels"):
        use_cpu_attention(WorkerConfig(cpu_attention="avx512"), torch.device("cpu"), False)
    assert use_cpu_attention(WorkerConfig(), torch.device("cpu"), False) is None
    assert use_cpu_attention(WorkerConfig(), torch.device("cpu"), True) == fastest


def test_ready_says_whether_the_worker_is_batch_invariant(model_dir: Path) -> None:
    for flag in (None, False):
        runner = ModelRunner(WorkerConfig(model=str(model_dir), dtype="bfloat16", block_size=BLOCK,
                                          num_blocks=NUM_BLOCKS, batch_invariant=flag))
        assert runner.ready_message().batch_invariant == (flag is None)
        kinds = {type(m).__name__ for m in runner.model.modules()}
        assert ("InvariantLinear" in kinds) == (flag is None)
        assert flag is not None or "Linear" not in kinds   # every linear layer, the head included


def bad_plans() -> dict[str, pb.StepPlan]:
    """Each breaks one rule, given seq 1 known with 3 blocks and 11 computed tokens."""
    new = pb.NewSequence(seq_id=9, sampling=pb.SamplingConfig())

    def chunk(**kw: object) -> pb.StepPlan:
        args: dict[str, object] = {"seq_id": 1, "start_position": 11, "token_ids": [4], "sample": True}
        args.update(kw)
        return pb.StepPlan(step_id=99, chunks=[pb.ScheduledChunk(**args)])  # type: ignore[arg-type]

    return {
        "unknown seq": chunk(seq_id=5),
        "unknown freed seq": pb.StepPlan(step_id=99, freed_seq_ids=[5]),
        "chunk of a freed seq": pb.StepPlan(step_id=99, freed_seq_ids=[1], chunks=chunk().chunks),
        "duplicate seq": pb.StepPlan(step_id=99, chunks=list(chunk().chunks) * 2),
        "block out of range": chunk(start_position=12, new_block_ids=[NUM_BLOCKS]),
        "beyond block table": chunk(start_position=12),
        "beyond context": chunk(start_position=256, new_block_ids=[0] * 62),
        "token outside vocab": chunk(token_ids=[320]),
        "empty token ids": chunk(token_ids=[]),
        "new seq already known": pb.StepPlan(step_id=99, new_sequences=[pb.NewSequence(seq_id=1)]),
        "new seq twice": pb.StepPlan(step_id=99, new_sequences=[new, new]),
        "negative temperature": pb.StepPlan(
            step_id=99, new_sequences=[pb.NewSequence(seq_id=9, sampling=pb.SamplingConfig(temperature=-1))]
        ),
        "over token budget": chunk(start_position=0, token_ids=list(range(65)), new_block_ids=list(range(14))),
        "block table beyond the context": chunk(new_block_ids=list(range(62))),   # 65 blocks; 256 tokens need 64
        "long chunk's token outside vocab": chunk(token_ids=[7] * 20 + [320]),       # (read through numpy)
        "masked chunk that does not sample": chunk(masked=True, sample=False),
        "new seq's token from a sample": pb.StepPlan(step_id=99, new_sequences=[new], chunks=[pb.ScheduledChunk(
            seq_id=9, start_position=0, last_token_from_sample=True, new_block_ids=[0], sample=True)]),
    }


@pytest.mark.parametrize("case", sorted(bad_plans()))
def test_bad_plan_is_rejected_and_state_kept(runner: ModelRunner, config: WorkerConfig, case: str) -> None:
    driver = Driver(runner)
    driver.add(1, PROMPTS[1])
    driver.generate([1], steps=1)  # 12 tokens, 11 computed, 3 blocks
    before = {sid: (vars(s).copy(), list(s.block_table)) for sid, s in runner.sequences.items()}
    with pytest.raises(PlanError, match="step 99"):
        runner.execute(bad_plans()[case])
    assert {sid: (vars(s).copy(), list(s.block_table)) for sid, s in runner.sequences.items()} == before
    driver.generate([1], steps=3)
    control = Driver(ModelRunner(config))
    control.add(1, PROMPTS[1])
    control.generate([1], steps=4)
    assert outputs(driver, 1) == outputs(control, 1)


def test_ready_message(runner: ModelRunner) -> None:
    ready = runner.ready_message()
    assert ready.protocol_version == pb.PROTOCOL_VERSION_2
    assert (ready.model_name, ready.vocab_size, ready.context_length) == ("tiny", 320, 256)
    assert list(ready.eos_token_ids) == [2]
    assert (ready.num_blocks, ready.block_size, ready.dtype, ready.device) == (NUM_BLOCKS, BLOCK, "float32", "cpu")


def test_worker_loop_over_zeromq(config: WorkerConfig, tmp_path: Path) -> None:
    scheduler = SchedulerSockets(f"ipc://{tmp_path}/plan", f"ipc://{tmp_path}/result")
    cfg = replace(config, plan_addr=f"ipc://{tmp_path}/plan", result_addr=f"ipc://{tmp_path}/result")
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(run_worker(cfg)))
    thread.start()
    try:
        assert scheduler.ready().num_blocks == NUM_BLOCKS
        scheduler.send(raw=b"\xff\xff garbage")
        assert scheduler.reply().HasField("error")
        plan = pb.StepPlan(step_id=3, new_sequences=[pb.NewSequence(seq_id=1)])
        plan.chunks.add(seq_id=1, start_position=0, token_ids=[1, 2, 3], new_block_ids=[0], sample=True)
        scheduler.send(plan=plan)
        reply = scheduler.reply()
        assert reply.result.step_id == 3 and list(reply.result.seq_ids) == [1] and reply.result.worker_seconds > 0
        assert reply.incarnation == scheduler.incarnation
        scheduler.send(plan=plan)  # seq 1 again: a bad plan
        assert "already known" in scheduler.reply().error.message
        scheduler.send(shutdown=pb.Shutdown())
        thread.join(timeout=30)
        assert exit_code == [0]
    finally:
        scheduler.close()


def _state(runner: ModelRunner) -> dict[int, tuple[dict, list[int], int]]:
    """The runner's per-sequence state: fields, block table, persistent-batch row."""
    return {sid: (vars(s).copy(), list(s.block_table), runner.batch.rows[sid]) for sid, s in runner.sequences.items()}


def test_worker_loop_discards_plans_after_a_failed_step_until_a_reset(config: WorkerConfig, tmp_path: Path) -> None:
    """After a StepError the loop answers every plan "discarded" without
    touching the runner; a reset plan forgets every sequence, then runs as a
    fresh runner would run it."""
    scheduler = SchedulerSockets(f"ipc://{tmp_path}/plan", f"ipc://{tmp_path}/result")
    cfg = replace(config, plan_addr=f"ipc://{tmp_path}/plan", result_addr=f"ipc://{tmp_path}/result")
    runners: list[ModelRunner] = []

    def make_runner(c: WorkerConfig) -> ModelRunner:
        runners.append(ModelRunner(c))
        return runners[-1]

    thread = threading.Thread(target=run_worker, args=(cfg, make_runner))
    thread.start()

    def start(step_id: int, sid: int, prompt: list[int], block: int, reset: bool = False) -> pb.StepPlan:
        plan = pb.StepPlan(step_id=step_id, reset=reset, new_sequences=[pb.NewSequence(seq_id=sid)])
        plan.chunks.add(seq_id=sid, start_position=0, token_ids=prompt, new_block_ids=[block], sample=True)
        return plan

    try:
        scheduler.ready()
        runner = runners[0]
        scheduler.send(plan=start(1, 1, PROMPTS[1][:3], 0))
        first = scheduler.reply().result
        before = _state(runner)
        scheduler.send(plan=pb.StepPlan(step_id=2, chunks=[pb.ScheduledChunk(seq_id=9, token_ids=[1], sample=True)]))
        assert "unknown seq_id 9" in scheduler.reply().error.message
        # Valid plans made assuming step 2 ran: a new sequence, a decode, a free.
        later = [start(3, 2, [5, 6], 1),
                 pb.StepPlan(step_id=4, chunks=[pb.ScheduledChunk(seq_id=1, start_position=3, new_block_ids=[2],
                                                                  last_token_from_sample=True, sample=True)]),
                 pb.StepPlan(step_id=5, freed_seq_ids=[1])]
        for plan in later:
            scheduler.send(plan=plan)
            error = scheduler.reply().error
            assert error.discarded and error.step_id == plan.step_id and "step 2 failed" in error.message
        assert _state(runner) == before
        # The reset plan: seq 1 is forgotten (a plan freeing it would be refused), seq 3 starts.
        scheduler.send(plan=start(6, 3, PROMPTS[1][:3], 4, reset=True))
        reset = scheduler.reply().result
        assert list(reset.seq_ids) == [3] and set(runner.sequences) == {3} and set(runner.batch.rows) == {3}
        assert (list(reset.token_ids), list(reset.logprobs)) == (list(first.token_ids), list(first.logprobs))
        scheduler.send(plan=pb.StepPlan(step_id=7, chunks=[pb.ScheduledChunk(
            seq_id=3, start_position=3, last_token_from_sample=True, sample=True)]))
        assert scheduler.reply().result.step_id == 7      # serving normally again
        scheduler.send(shutdown=pb.Shutdown())
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        scheduler.close()
