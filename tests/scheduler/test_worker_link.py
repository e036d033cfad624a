"""The scheduler's ZeroMQ link on real sockets: malformed frames, heartbeats,
a silent worker, a restarted worker, fencing of a stale incarnation. Test
sockets play the worker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from jitney.common.incarnation import new_incarnation
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.worker_link import WorkerLink, WorkerLinkError, WorkerLostError
from tests.support.engine_sockets import WORKER_INCARNATION, WorkerSockets
from tests.support.worker_link_harness import (FakeWorkerSockets, heartbeat_frame, ready_frame, result_frame,
                                                run_on_link)


async def _connections_become(link: WorkerLink, count: int) -> bool:
    """Whether the link counts ``count`` connections within a second."""
    for _ in range(50):
        if link.num_connections == count:
            return True
        await asyncio.sleep(0.02)
    return link.num_connections == count


def test_malformed_frames_are_dropped_and_logged(tmp_path: Path, caplog) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(b"\xff\xfe garbage, not a protobuf")
        await w.send(b"")      # parses, but carries nothing
        await w.send(ready_frame())
        ready = await waiting
        assert ready.worker_pid == 4242 and w.link.is_serving
        plan = engine_pb2.StepPlan(step_id=1)
        stepping = asyncio.ensure_future(w.link.step(plan))
        got = engine_pb2.SchedulerMessage.FromString(await w.pull.recv())
        assert got.plan.step_id == 1
        await w.send(b"\x0a\x05trunc")   # a truncated field
        await w.send(result_frame(1))
        result = await stepping
        assert list(result.token_ids) == [7]

    with caplog.at_level(logging.ERROR, logger="jitney.scheduler"):
        run_on_link(body, tmp_path)
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 3, [r.getMessage() for r in caplog.records]


def test_heartbeats_keep_a_worker_alive_and_silence_loses_it(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(ready_frame(pid=0))     # pid 0: nothing to kill
        await waiting
        for _ in range(5):              # 1 s of heartbeats, timeout 0.6 s
            await asyncio.sleep(0.2)
            await w.send(heartbeat_frame())
        assert w.link.is_serving
        receiving = asyncio.ensure_future(w.link.receive())
        reason = await w.link.wait_lost()
        assert "no message" in reason and not w.link.is_serving
        with pytest.raises(WorkerLostError):
            await receiving
        with pytest.raises(WorkerLostError):
            await w.link.send_plan(engine_pb2.StepPlan(step_id=2))
        # A new worker's Ready brings the link back; old results are gone.
        await w.serve_first()
        assert w.link.is_serving

    run_on_link(body, tmp_path)


def test_a_new_ready_while_serving_means_the_worker_restarted(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        await w.serve_first()
        new = w.another()
        await new.send(ready_frame(pid=0, incarnation=new.incarnation))
        reason = await w.link.wait_lost()
        assert "sent Ready" in reason
        again = await w.link.wait_ready()     # the queued Ready
        assert again.protocol_version == engine_pb2.PROTOCOL_VERSION_2 and w.link.is_serving
        assert w.link.incarnation == new.incarnation
        # The replaced worker is told to shut down; the new one gets the plans.
        told = await w.workers[0].recv()
        assert told.HasField("shutdown") and told.incarnation == WORKER_INCARNATION
        await w.link.send_plan(engine_pb2.StepPlan(step_id=1))
        got = await new.recv()
        assert got.plan.step_id == 1 and got.incarnation == new.incarnation

    run_on_link(body, tmp_path)


@pytest.mark.parametrize("version", [engine_pb2.PROTOCOL_VERSION_UNSPECIFIED, engine_pb2.PROTOCOL_VERSION_1])
def test_a_worker_of_another_protocol_is_refused(tmp_path: Path, version: int) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(engine_pb2.WorkerMessage(ready=engine_pb2.Ready(
            protocol_version=version)).SerializeToString())   # (an old worker: no incarnation)
        with pytest.raises(WorkerLinkError, match=f"engine protocol {version}, this scheduler speaks 2"):
            await waiting

    run_on_link(body, tmp_path)


def test_a_ready_without_a_valid_incarnation_is_refused(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(ready_frame(incarnation=5))     # top byte 0: no valid routing id
        with pytest.raises(WorkerLinkError, match="valid incarnation"):
            await waiting

    run_on_link(body, tmp_path)


def test_frames_of_a_stale_incarnation_are_dropped_counted_and_told_to_shut_down(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        old = w.workers[0]
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await old.send(ready_frame(pid=0))
        await waiting
        await w.link.send_plan(engine_pb2.StepPlan(step_id=1))
        assert (await old.recv()).plan.step_id == 1
        # The old worker goes silent (hung) and is lost; a new one is served.
        await w.link.wait_lost()
        assert (await old.recv()).HasField("shutdown")     # told at once, should it wake
        new = w.another()
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await new.send(ready_frame(pid=0, incarnation=new.incarnation))
        await waiting
        stepping = asyncio.ensure_future(w.link.step(engine_pb2.StepPlan(step_id=1)))
        assert (await new.recv()).plan.step_id == 1
        # The old one wakes: its late result and heartbeats are dropped, not taken for the new one's.
        await old.send(result_frame(1, incarnation=old.incarnation, token=666))
        for _ in range(3):
            await old.send(heartbeat_frame(old.incarnation))
        await new.send(result_frame(1, incarnation=new.incarnation, token=7))
        assert list((await stepping).token_ids) == [7]
        while w.link.num_stale_frames < 4:     # (the two workers' frames arrive in any order)
            await asyncio.sleep(0.01)
        for _ in range(4):      # one Shutdown per stale frame
            told = await old.recv()
            assert told.HasField("shutdown") and told.incarnation == old.incarnation
        assert await new.plans.poll(100) == 0       # the new worker was told nothing

    with caplog.at_level(logging.WARNING, logger="jitney.scheduler"):
        run_on_link(body, tmp_path)
    stale = [r for r in caplog.records if "not served" in r.getMessage()]
    assert len(stale) == 1, [r.getMessage() for r in caplog.records]   # logged once per incarnation


def test_a_worker_that_outlived_its_scheduler_is_told_to_shut_down(tmp_path: Path) -> None:
    """A new scheduler hears heartbeats from a worker that never sent it a
    Ready: it tells that worker to exit (restarted, it sends a Ready)."""
    async def body(w: FakeWorkerSockets) -> None:
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(heartbeat_frame())
        told = await w.workers[0].recv()
        assert told.HasField("shutdown") and told.incarnation == WORKER_INCARNATION
        assert not waiting.done() and w.link.num_stale_frames == 1
        waiting.cancel()

    run_on_link(body, tmp_path)


def test_a_plan_waits_for_the_route_of_a_worker_that_connects_late(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        incarnation = new_incarnation()
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await w.send(ready_frame(pid=0, incarnation=incarnation))    # its plan socket is not connected yet
        await waiting
        sending = asyncio.ensure_future(w.link.send_plan(engine_pb2.StepPlan(step_id=1)))
        await asyncio.sleep(0.2)
        assert not sending.done()
        late = WorkerSockets(w.ctx, w.link.plan_addr, w.link.result_addr, incarnation)
        w.workers.append(late)
        await sending
        got = await late.recv()
        assert got.plan.step_id == 1 and got.incarnation == incarnation

    run_on_link(body, tmp_path)


@pytest.mark.slow
def test_real_worker_answers_garbage_with_step_errors_and_keeps_serving(tmp_path: Path) -> None:
    """The worker process on real sockets: garbage in, StepError out, no crash;
    a message for another incarnation is dropped; after a failed step, plans
    are discarded until a reset plan."""
    import subprocess
    import sys

    from tests.support.server_harness import ROOT
    from tests.support.tiny_models import make_tiny_llama
    from tests.support.engine_sockets import SchedulerSockets

    model = make_tiny_llama(tmp_path / "tiny")
    plan_addr, result_addr = f"ipc://{tmp_path}/plan", f"ipc://{tmp_path}/result"
    scheduler = SchedulerSockets(plan_addr, result_addr, timeout_ms=60_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jitney.cli", "worker", "--model", str(model), "--num-blocks", "8",
         "--dtype", "float32", "--plan-addr", plan_addr, "--result-addr", result_addr], cwd=ROOT)

    try:
        scheduler.ready()
        bad_plan = engine_pb2.StepPlan(
            step_id=1, chunks=[engine_pb2.ScheduledChunk(seq_id=99, token_ids=[1], sample=True)])
        elsewhere = engine_pb2.SchedulerMessage(plan=engine_pb2.StepPlan(step_id=9), incarnation=new_incarnation())
        scheduler.send(raw=elsewhere.SerializeToString())     # for another incarnation: dropped unanswered
        for message, words in [(dict(raw=b"\xff\xfe not a protobuf"), "undecodable"),
                               (dict(), "without a known kind"),
                               (dict(plan=bad_plan), "bad plan"),
                               (dict(plan=engine_pb2.StepPlan(step_id=2)), "discarded: step 1 failed")]:
            scheduler.send(**message)
            msg = scheduler.reply()
            assert msg.WhichOneof("kind") == "error" and words in msg.error.message, msg
            assert msg.error.discarded == (words.startswith("discarded")) and msg.incarnation == scheduler.incarnation
        scheduler.send(plan=engine_pb2.StepPlan(step_id=3, reset=True))
        msg = scheduler.reply()
        assert msg.WhichOneof("kind") == "result" and msg.result.step_id == 3
        scheduler.send(shutdown=engine_pb2.Shutdown())
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        scheduler.close()


def test_a_worker_whose_connection_closes_is_lost_at_once(tmp_path: Path) -> None:
    """A killed worker's sockets close with it: the link loses it on the spot,
    well before its silence timeout, and a new worker is served after."""
    async def body(w: FakeWorkerSockets) -> None:
        w.link.worker_timeout = 30.0    # silence alone would take 30 s
        await w.serve_first()
        assert w.link.num_connections == 1
        closed = asyncio.get_running_loop().time()
        w.workers[0].close()            # what the kernel does for a killed process
        reason = await asyncio.wait_for(w.link.wait_lost(), 2.0)
        assert "connection closed" in reason and not w.link.is_serving
        assert asyncio.get_running_loop().time() - closed < 2.0
        new = w.another()
        waiting = asyncio.ensure_future(w.link.wait_ready())
        await new.send(ready_frame(pid=0, incarnation=new.incarnation))
        await waiting
        assert w.link.is_serving and w.link.incarnation == new.incarnation
        await w.link.send_plan(engine_pb2.StepPlan(step_id=1))
        assert (await new.recv()).plan.step_id == 1

    run_on_link(body, tmp_path)


def test_a_second_connection_closing_does_not_lose_the_served_worker(tmp_path: Path) -> None:
    async def body(w: FakeWorkerSockets) -> None:
        await w.serve_first()
        other = w.another()             # e.g. a stale worker, or a standby's first connect
        await other.send(heartbeat_frame(other.incarnation))
        assert await _connections_become(w.link, 2)
        other.close()
        assert await _connections_become(w.link, 1) and w.link.is_serving
        await w.send(result_frame(1))        # the served worker is still heard
        assert w.link.is_serving

    run_on_link(body, tmp_path)
