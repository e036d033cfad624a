"""Fencing (engine protocol 2): a worker that hung, was declared lost and wakes
up cannot take plans or have its replies read; the watchdog ends a hung
worker; a failed step is recovered from on the real worker loop.

Worker loops run in threads here (``run_worker`` with a runner given by the
test) against a real ``WorkerLink``; one test runs real worker processes and
stops one with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.server_harness import ROOT, free_port
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.engine import Engine
from jitney.scheduler.core.request import SamplingOptions
from jitney.scheduler.core.request import ValidatedRequest
from jitney.scheduler.core.worker_link import WorkerLink
from jitney.worker.config import WorkerConfig
from jitney.worker.main import run_worker
from tests.support.fake_worker import VOCAB, FakeWorker, expected_token
from tests.support.engine_requests import LetterTokenizer, collect

NUM_BLOCKS, BLOCK = 16, 4


def tcp_link(worker_timeout: float) -> WorkerLink:
    return WorkerLink(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                      worker_timeout=worker_timeout, insecure_plaintext=True)


def worker_config(link: WorkerLink, **fields: Any) -> WorkerConfig:
    return WorkerConfig(plan_addr=link.plan_addr, result_addr=link.result_addr, insecure_plaintext_zmq=True,
                        **fields)


class StallingRunner:
    """A runner on the fake worker that can hang in one step until released."""

    def __init__(self, stall_at: int = 0) -> None:
        self.worker = FakeWorker(NUM_BLOCKS, BLOCK)
        self.stall_at = stall_at
        self.release = threading.Event()
        self.steps: list[int] = []

    def ready_message(self) -> engine_pb2.Ready:
        return engine_pb2.Ready(protocol_version=engine_pb2.PROTOCOL_VERSION_2, vocab_size=VOCAB,
                                context_length=NUM_BLOCKS * BLOCK, num_blocks=NUM_BLOCKS, block_size=BLOCK)

    def execute(self, plan: engine_pb2.StepPlan, wait_for_masks: object = None) -> engine_pb2.StepResult:
        self.steps.append(plan.step_id)
        if plan.step_id == self.stall_at:
            assert self.release.wait(30)
        return self.worker.execute(plan)


def start_worker(config: WorkerConfig, runner: object) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_worker(config, lambda _c: runner)), daemon=True)
    thread.start()
    return thread, codes


PROMPT = [5, 9, 2]


def plans() -> list[engine_pb2.StepPlan]:
    """Seq 1: the prompt, then two decodes."""
    first = engine_pb2.StepPlan(step_id=1, new_sequences=[engine_pb2.NewSequence(seq_id=1)])
    first.chunks.add(seq_id=1, start_position=0, token_ids=PROMPT, new_block_ids=[0], sample=True)
    decodes = [engine_pb2.StepPlan(step_id=step, chunks=[engine_pb2.ScheduledChunk(
        seq_id=1, start_position=start, last_token_from_sample=True, sample=True, new_block_ids=blocks)])
        for step, start, blocks in ((2, 3, []), (3, 4, [1]))]
    return [first, *decodes]


def expected(n: int) -> list[int]:
    history = list(PROMPT)
    for _ in range(n):
        history.append(expected_token(history))
    return history[len(PROMPT):]


def test_a_stalled_worker_that_wakes_takes_no_plan_and_is_not_heard() -> None:
    """Over tcp (no kill by pid): the old worker stalls in step 2 while still
    connected, is declared lost, a new one serves; when the old one wakes its
    result is dropped and it exits on the link's Shutdown; it never saw a plan
    meant for the new one, whose results are intact."""
    async def main() -> None:
        link = tcp_link(worker_timeout=0.5)
        old, new = StallingRunner(stall_at=2), StallingRunner()
        old_thread, old_codes = start_worker(worker_config(link), old)
        new_thread = None
        try:
            await link.wait_ready()
            old_incarnation = link.incarnation
            first, second, third = plans()
            assert list((await link.step(first)).token_ids) == expected(1)
            await link.send_plan(second)
            assert "no message" in await link.wait_lost()
            new_thread, _ = start_worker(worker_config(link), new)
            await link.wait_ready()
            assert link.incarnation != old_incarnation
            got = [list((await link.step(plan)).token_ids)[0] for plan in (first, second)]
            old.release.set()           # it wakes: answers step 2, reads its Shutdown, exits
            await asyncio.to_thread(old_thread.join, 10)
            assert old_codes == [0]
            got.append(list((await link.step(third)).token_ids)[0])
            assert got == expected(3)
            assert old.steps == [1, 2] and new.steps == [1, 2, 3]
            assert link.num_stale_frames >= 1
            await link.send_shutdown()
        finally:
            old.release.set()
            for thread in (old_thread, new_thread):
                if thread is not None:
                    await asyncio.to_thread(thread.join, 10)
            link.close()
    asyncio.run(main())


def test_the_watchdog_dumps_the_stacks_and_exits() -> None:
    code = ("import time; from jitney.worker.runner.watchdog import Watchdog\n"
            "w = Watchdog(0.5); w.arm(); time.sleep(0.3); w.arm()   # re-armed in time\n"
            "time.sleep(30)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 1 and 0.7 < time.monotonic() - started < 20
    assert "Timeout (0:00:00.500000)!" in proc.stderr and "most recent call first" in proc.stderr


def test_hang_timeout_must_leave_room_for_the_heartbeat_wait() -> None:
    with pytest.raises(ValueError, match="hang_timeout"):
        WorkerConfig(hang_timeout=1.0)
    assert WorkerConfig(hang_timeout=0).hang_timeout == 0


@pytest.mark.slow
def test_a_sigstopped_worker_process_exits_when_continued(tmp_path: Path) -> None:
    """Real worker processes over tcp: A is stopped and lost, B serves; when A
    continues, its watchdog (stopped longer than --hang-timeout) or the
    link's Shutdown ends it at once, and B's results stay intact."""
    from tests.support.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")

    async def main() -> None:
        link = tcp_link(worker_timeout=1.5)
        argv = [sys.executable, "-m", "jitney.cli", "worker", "--model", str(model), "--num-blocks", "16",
                "--block-size", "4", "--dtype", "float32", "--threads", "1", "--plan-addr", link.plan_addr,
                "--result-addr", link.result_addr, "--insecure-plaintext-zmq", "--hang-timeout", "3"]
        procs = [subprocess.Popen(argv, cwd=ROOT, stderr=open(tmp_path / "a.err", "w"))]
        try:
            await asyncio.wait_for(link.wait_ready(), 120)
            first = await link.step(plans()[0])
            await asyncio.sleep(4)               # idle longer than --hang-timeout: the loop re-arms
            assert procs[0].poll() is None
            os.kill(procs[0].pid, signal.SIGSTOP)
            stopped = time.monotonic()
            await asyncio.wait_for(link.wait_lost(), 10)
            procs.append(subprocess.Popen(argv, cwd=ROOT))
            await asyncio.wait_for(link.wait_ready(), 120)
            assert list((await link.step(plans()[0])).token_ids) == list(first.token_ids)
            await asyncio.sleep(max(0.0, stopped + 4 - time.monotonic()))
            os.kill(procs[0].pid, signal.SIGCONT)
            code = await asyncio.to_thread(procs[0].wait, 10)
            assert code in (0, 1), code      # 0: it read the Shutdown first; 1: the watchdog fired first
            if code == 1:
                assert "most recent call first" in (tmp_path / "a.err").read_text()
            assert (await link.step(plans()[1])).step_id == 2     # B serves on, undisturbed
            await link.send_shutdown()
            assert await asyncio.to_thread(procs[1].wait, 30) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                    proc.wait()
            link.close()
    asyncio.run(main())


# -- a failed step on the real worker loop ----------------------------------------------

def failing_runner_factory(fail_at: int, ran: list[int]) -> Callable[[WorkerConfig], object]:
    from jitney.worker.runner.model_runner import ModelRunner

    class FailingRunner(ModelRunner):
        """Fails step ``fail_at`` after running it (its state changed, as a crash mid-step leaves it)."""

        def __init__(self, config: WorkerConfig) -> None:
            self.serving = False
            super().__init__(config)    # (its warm-up steps run through execute too)
            self.serving = True

        def execute(self, plan: engine_pb2.StepPlan, wait_for_masks: Any = None) -> engine_pb2.StepResult:
            if not self.serving:
                return super().execute(plan, wait_for_masks)
            ran.append(plan.step_id)
            result = super().execute(plan, wait_for_masks)
            if plan.step_id == fail_at:
                raise RuntimeError("injected failure")
            return result

    return FailingRunner


async def serve_requests(model: Path, tmp_path: Path, fail_at: int) -> tuple[list[Any], dict, list[int], Engine]:
    """Three greedy requests through an Engine, the real link and the real
    worker loop (a thread). The budget (8) makes step 1 the first prompt
    only, and step 2, planned while step 1 runs, the second's and the
    third's first chunk with the first's decode. Returns the events, the
    plans sent, the steps the runner ran, the engine."""
    tmp_path.mkdir(mode=0o700)
    link = WorkerLink(f"ipc://{tmp_path}/plan", f"ipc://{tmp_path}/result", worker_timeout=30)
    sent: dict[int, engine_pb2.StepPlan] = {}
    ran: list[int] = []
    send_plan = link.send_plan

    async def record_and_send(plan: engine_pb2.StepPlan) -> None:
        sent[plan.step_id] = plan
        await send_plan(plan)
    link.send_plan = record_and_send  # type: ignore[method-assign]
    config = WorkerConfig(model=str(model), dtype="float32", block_size=BLOCK, num_blocks=64,
                          max_num_batched_tokens=8, max_num_seqs=4, plan_addr=link.plan_addr,
                          result_addr=link.result_addr)
    thread = threading.Thread(target=run_worker, args=(config, failing_runner_factory(fail_at, ran)))
    thread.start()
    try:
        ready = await asyncio.wait_for(link.wait_ready(), 60)
        sched = SchedulerConfig(block_size=BLOCK, num_blocks=ready.num_blocks, max_model_len=128,
                                max_num_seqs=4, max_num_batched_tokens=8)
        engine = Engine(sched, link, LetterTokenizer(), frozenset())
        prompts = [[11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44, 45], [70, 71, 72]]
        handles = [engine.submit(ValidatedRequest(tuple(p), SamplingOptions(max_tokens=10, ignore_eos=True),
                                                  f"r{i}")) for i, p in enumerate(prompts)]
        loop = asyncio.create_task(engine.run())
        events = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 120)
        engine.scheduler.check_invariants()
        engine.close("done")
        loop.cancel()
        await link.send_shutdown()
        return list(events), sent, ran, engine
    finally:
        await asyncio.to_thread(thread.join, 30)
        link.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("fencing") / "tiny")


def test_a_failed_step_on_the_real_worker_loop_spares_the_overlapped_bystanders(
        tiny_model: Path, tmp_path: Path) -> None:
    control, _, _, _ = asyncio.run(serve_requests(tiny_model, tmp_path / "control", fail_at=0))
    events, seen, ran, engine = asyncio.run(serve_requests(tiny_model, tmp_path / "fault", fail_at=1))
    assert [c.seq_id for c in seen[1].chunks] == [1]                   # step 1: request 0 alone
    assert {c.seq_id for c in seen[2].chunks} == {1, 2, 3}             # step 2: planned while 1 ran
    assert 2 not in ran and seen[3].reset                              # discarded; then the reset
    assert events[0][-1].error_code == "INTERNAL"
    for got, want in zip(events[1:], control[1:]):
        assert got[-1].finish_reason is not None
        assert [t for e in got for t in e.token_ids] == [t for e in want for t in e.token_ids]
        assert [p for e in got for p in e.logprobs] == [p for e in want for p in e.logprobs]
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert engine.num_preemptions >= 2
