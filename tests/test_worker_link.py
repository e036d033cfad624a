"""The scheduler's ZeroMQ link on real sockets: malformed frames, heartbeats,
a silent worker, a restarted worker. A test socket plays the worker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.worker_link import WorkerLink, WorkerLinkError, WorkerLostError


def _ready(pid: int = 4242) -> bytes:
    return engine_pb2.WorkerMessage(ready=engine_pb2.Ready(
        protocol_version=engine_pb2.PROTOCOL_VERSION_1, num_blocks=8, block_size=4,
        worker_pid=pid)).SerializeToString()


def _heartbeat() -> bytes:
    return engine_pb2.WorkerMessage(heartbeat=engine_pb2.Heartbeat(worker_pid=1)).SerializeToString()


def _result(step_id: int) -> bytes:
    return engine_pb2.WorkerMessage(result=engine_pb2.StepResult(
        step_id=step_id, seq_ids=[1], token_ids=[7], logprobs=[-0.5])).SerializeToString()


class FakeWorkerSockets:
    def __init__(self, tmp: Path) -> None:
        self.link = WorkerLink(f"ipc://{tmp}/plan", f"ipc://{tmp}/result", worker_timeout=0.6)
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.push = self.ctx.socket(zmq.PUSH)
        self.pull.connect(self.link.plan_addr)
        self.push.connect(self.link.result_addr)

    async def send(self, frame: bytes) -> None:
        await self.push.send(frame)

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()
        self.link.close()


def run(coro_fn, tmp: Path) -> None:
    async def main() -> None:
        sockets = FakeWorkerSockets(tmp)
        try:
            await asyncio.wait_for(coro_fn(sockets), 10)
        finally:
            sockets.close()
    asyncio.run(main())


def test_malformed_frames_are_dropped_and_logged(tmp_path: Path, caplog) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(b"\xff\xfe garbage, not a protobuf")
        await w.send(b"")      # parses, but carries nothing
        await w.send(_ready())
        ready = await waiting
        assert ready.worker_pid == 4242 and w.link.is_serving
        plan = engine_pb2.StepPlan(step_id=1)
        stepping = asyncio.ensure_future(w.link.step(plan))
        got = engine_pb2.SchedulerMessage.FromString(await w.pull.recv())
        assert got.plan.step_id == 1
        await w.send(b"\x0a\x05trunc")   # a truncated field
        await w.send(_result(1))
        result = await stepping
        assert list(result.token_ids) == [7]

    with caplog.at_level(logging.ERROR, logger="jitney.scheduler"):
        run(body, tmp_path)
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 3, [r.getMessage() for r in caplog.records]


def test_heartbeats_keep_a_worker_alive_and_silence_loses_it(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(_ready(pid=0))     # pid 0: nothing to kill
        await waiting
        for _ in range(5):              # 1 s of heartbeats, timeout 0.6 s
            await asyncio.sleep(0.2)
            await w.send(_heartbeat())
        assert w.link.is_serving
        receiving = asyncio.ensure_future(w.link.receive())
        reason = await w.link.wait_lost()
        assert "no message" in reason and not w.link.is_serving
        with pytest.raises(WorkerLostError):
            await receiving
        with pytest.raises(WorkerLostError):
            await w.link.send_plan(engine_pb2.StepPlan(step_id=2))
        # A new worker's Ready brings the link back; old results are gone.
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(_ready(pid=0))
        await waiting
        assert w.link.is_serving

    run(body, tmp_path)


def test_a_new_ready_while_serving_means_the_worker_restarted(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(_ready(pid=0))
        await waiting
        await w.send(_ready(pid=0))
        reason = await w.link.wait_lost()
        assert "sent Ready" in reason
        again = await w.link.wait_ready()     # the queued Ready
        assert again.protocol_version == engine_pb2.PROTOCOL_VERSION_1 and w.link.is_serving

    run(body, tmp_path)


def test_a_worker_of_another_protocol_is_refused(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(engine_pb2.WorkerMessage(ready=engine_pb2.Ready(
            protocol_version=engine_pb2.PROTOCOL_VERSION_UNSPECIFIED)).SerializeToString())
        with pytest.raises(WorkerLinkError):
            await waiting

    run(body, tmp_path)


@pytest.mark.slow
def test_real_worker_answers_garbage_with_step_errors_and_keeps_serving(tmp_path: Path) -> None:
    """The worker process on real sockets: garbage in, StepError out, no crash."""
    import subprocess
    import sys

    from bench.server_harness import ROOT
    from bench.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    ctx = zmq.Context()
    plans, results = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    plan_addr, result_addr = f"ipc://{tmp_path}/plan", f"ipc://{tmp_path}/result"
    plans.bind(plan_addr)
    results.bind(result_addr)
    results.setsockopt(zmq.RCVTIMEO, 60_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jitney.cli", "worker", "--model", str(model), "--num-blocks", "8",
         "--dtype", "float32", "--plan-addr", plan_addr, "--result-addr", result_addr], cwd=ROOT)

    def reply() -> engine_pb2.WorkerMessage:
        while True:
            msg = engine_pb2.WorkerMessage.FromString(results.recv())
            if msg.WhichOneof("kind") != "heartbeat":
                return msg

    try:
        assert reply().WhichOneof("kind") == "ready"
        bad_plan = engine_pb2.SchedulerMessage(plan=engine_pb2.StepPlan(
            step_id=1, chunks=[engine_pb2.ScheduledChunk(seq_id=99, token_ids=[1], sample=True)]))
        for frame, words in [(b"\xff\xfe not a protobuf", "undecodable"),
                             (b"", "without a known kind"),
                             (bad_plan.SerializeToString(), "bad plan")]:
            plans.send(frame)
            msg = reply()
            assert msg.WhichOneof("kind") == "error" and words in msg.error.message, msg
        plans.send(engine_pb2.SchedulerMessage(plan=engine_pb2.StepPlan(step_id=2)).SerializeToString())
        msg = reply()
        assert msg.WhichOneof("kind") == "result" and msg.result.step_id == 2
        plans.send(engine_pb2.SchedulerMessage(shutdown=engine_pb2.Shutdown()).SerializeToString())
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        plans.close(0)
        results.close(0)
        ctx.term()
