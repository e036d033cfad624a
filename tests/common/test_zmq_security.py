"""CurveZMQ on the scheduler <-> worker link (jitney.common.zmq_security): keys on
disk, which endpoints need them, and rogue sockets that must get nothing and
change nothing while a keyed worker is served."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from zmq.auth.thread import AuthenticationThread

from tests.support.server_harness import ROOT, free_port
from jitney.cli import main as jitney_main
from jitney.common.incarnation import new_incarnation, routing_id
from jitney.common.zmq_security import (ClientKeys, LinkSecurityError, check_endpoint, client_side,
                                        generate_keys, load_client_keys, load_server_keys)
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.launch import supervisor
from jitney.scheduler.core.worker_link import WorkerLink


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- keys on disk ---------------------------------------------------------------

def test_generated_keys_are_private_and_each_side_loads_its_own(keys: Path) -> None:
    assert _mode(keys) == 0o700
    assert {p.name: _mode(p) for p in keys.iterdir()} == {
        "server.key": 0o644, "server.key_secret": 0o600, "worker.key": 0o644, "worker.key_secret": 0o600}
    server, client = load_server_keys(keys), load_client_keys(keys)
    assert client.server_public == server.public
    assert server.trusted_workers == {client.public}      # not its own public key
    assert zmq.curve_public(server.secret) == server.public


def test_split_keys_give_neither_side_the_others_secret(tmp_path: Path) -> None:
    generate_keys(tmp_path / "k", split=True)
    assert sorted(p.name for p in (tmp_path / "k/scheduler").iterdir()) == ["server.key_secret", "worker.key"]
    assert sorted(p.name for p in (tmp_path / "k/worker").iterdir()) == ["server.key", "worker.key_secret"]
    assert {_mode(tmp_path / "k"), _mode(tmp_path / "k/scheduler"), _mode(tmp_path / "k/worker")} == {0o700}
    server, client = load_server_keys(tmp_path / "k/scheduler"), load_client_keys(tmp_path / "k/worker")
    assert client.server_public == server.public and server.trusted_workers == {client.public}


def test_existing_keys_are_never_overwritten(keys: Path) -> None:
    before = (keys / "server.key_secret").read_bytes()
    with pytest.raises(LinkSecurityError, match="refusing to overwrite"):
        generate_keys(keys)
    assert generate_keys(keys, if_missing=True) == []
    (keys / "worker.key").unlink()
    with pytest.raises(LinkSecurityError, match="already exist"):
        generate_keys(keys, if_missing=True)     # a partial set is not completed silently
    assert (keys / "server.key_secret").read_bytes() == before


def test_a_secret_key_others_can_read_is_refused(keys: Path) -> None:
    os.chmod(keys / "server.key_secret", 0o640)
    with pytest.raises(LinkSecurityError, match=r"group or others \(mode 0640\).*chmod 600"):
        load_server_keys(keys)
    os.chmod(keys / "worker.key_secret", 0o604)
    with pytest.raises(LinkSecurityError, match="group or others"):
        load_client_keys(keys)


def test_missing_or_mismatched_keys_are_refused(keys: Path, tmp_path: Path) -> None:
    with pytest.raises(LinkSecurityError, match="missing Curve secret key file.*jitney keys --out"):
        load_server_keys(tmp_path)
    text = (keys / "worker.key_secret").read_text()
    other_public = zmq.curve_keypair()[0].decode()
    old_public = load_client_keys(keys).public.decode()
    (keys / "worker.key_secret").write_text(text.replace(old_public, other_public))
    with pytest.raises(LinkSecurityError, match="does not belong"):
        load_client_keys(keys)
    (keys / "worker.key").unlink()
    with pytest.raises(LinkSecurityError, match="would admit no worker"):
        load_server_keys(keys)


def test_jitney_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert jitney_main(["keys", "--out", str(tmp_path / "k")]) == 0
    assert load_client_keys(tmp_path / "k").server_public == load_server_keys(tmp_path / "k").public
    assert jitney_main(["keys", "--out", str(tmp_path / "k")]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert jitney_main(["keys", "--out", str(tmp_path / "k"), "--if-missing"]) == 0


# -- which endpoints need keys -----------------------------------------------------

def test_tcp_needs_keys_or_the_explicit_insecure_flag(tmp_path: Path) -> None:
    with pytest.raises(LinkSecurityError, match="jitney keys --out DIR.*--insecure-plaintext-zmq"):
        check_endpoint("tcp://scheduler:5557", have_keys=False, insecure_plaintext=False)
    check_endpoint("tcp://scheduler:5557", have_keys=True, insecure_plaintext=False)
    check_endpoint("tcp://scheduler:5557", have_keys=False, insecure_plaintext=True)
    check_endpoint("inproc://link", have_keys=False, insecure_plaintext=False)
    check_endpoint(f"ipc://{tmp_path}/plan", have_keys=False, insecure_plaintext=False)   # 0700


def test_ipc_in_a_folder_others_can_enter_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(LinkSecurityError, match=r"not private.*chmod 700"):
        check_endpoint(f"ipc://{shared}/plan", have_keys=False, insecure_plaintext=False)
    with pytest.raises(LinkSecurityError, match="abstract socket"):
        check_endpoint("ipc://@jitney-plan", have_keys=False, insecure_plaintext=False)
    check_endpoint(f"ipc://{shared}/plan", have_keys=True, insecure_plaintext=False)   # Curve guards it


def test_scheduler_and_worker_refuse_to_start_without_keys(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    tcp = ["--plan-addr", f"tcp://127.0.0.1:{free_port()}", "--result-addr", f"tcp://127.0.0.1:{free_port()}"]
    assert jitney_main(["scheduler", *tcp]) == 2
    assert "jitney scheduler: tcp://127.0.0.1" in capsys.readouterr().err
    assert jitney_main(["worker", *tcp]) == 2
    err = capsys.readouterr().err
    assert "jitney worker: tcp://127.0.0.1" in err and "jitney keys --out DIR" in err
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o750)
    ipc = ["--plan-addr", f"ipc://{shared}/p", "--result-addr", f"ipc://{shared}/r"]
    assert jitney_main(["scheduler", *ipc]) == 2
    assert "is not private" in capsys.readouterr().err


def test_serve_checks_the_key_folder_before_starting_anything(keys: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(keys / "worker.key_secret", 0o640)
    assert jitney_main(["serve", "--curve-keys", str(keys)]) == 2
    assert "jitney serve:" in capsys.readouterr().err


def test_the_supervisors_link_folder_is_private(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}

    def fake_run(self: supervisor._Supervisor) -> int:
        addr = self.scheduler_cmd[self.scheduler_cmd.index("--plan-addr") + 1]
        folder = Path(addr.removeprefix("ipc://")).parent
        seen.update(mode=_mode(folder), uid=folder.stat().st_uid)
        check_endpoint(addr, have_keys=False, insecure_plaintext=False)     # what the scheduler checks
        return 0

    monkeypatch.setattr(supervisor._Supervisor, "run", fake_run)
    assert supervisor.supervise([], []) == 0
    assert seen == {"mode": 0o700, "uid": os.geteuid()}


# -- rogue sockets on a Curve link ---------------------------------------------------

def _message(incarnation: int, **kind: Any) -> bytes:
    return engine_pb2.WorkerMessage(incarnation=incarnation, **kind).SerializeToString()


def _ready(incarnation: int, pid: int) -> bytes:
    return _message(incarnation, ready=engine_pb2.Ready(
        protocol_version=engine_pb2.PROTOCOL_VERSION_2, num_blocks=8, block_size=4, worker_pid=pid))


def _result(incarnation: int, step_id: int, token: int) -> bytes:
    return _message(incarnation, result=engine_pb2.StepResult(
        step_id=step_id, seq_ids=[1], token_ids=[token], logprobs=[-0.5]))


class Peer:
    """A would-be worker's two sockets, as the real worker sets them up: a DEALER
    for plans (routing id = its incarnation), a PUSH for its messages. ``keys``
    None: plain ZeroMQ, no Curve at all."""

    def __init__(self, ctx: zmq.asyncio.Context, link: WorkerLink, keys: ClientKeys | None,
                 incarnation: int) -> None:
        self.incarnation = incarnation
        self.plans, self.push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
        self.plans.setsockopt(zmq.ROUTING_ID, routing_id(incarnation))
        for sock, endpoint in ((self.plans, link.plan_addr), (self.push, link.result_addr)):
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                client_side(sock, endpoint, keys)
            sock.connect(endpoint)

    async def got_nothing(self, seconds: float = 0.3) -> bool:
        return await self.plans.poll(int(seconds * 1000)) == 0

    def close(self) -> None:
        self.plans.close(0)
        self.push.close(0)


def _stranger(keys: Path) -> ClientKeys:
    """A random key pair that knows the scheduler's public key, but is not trusted."""
    public, secret = zmq.curve_keypair()
    return ClientKeys(public, secret, load_client_keys(keys).server_public)


def _auth_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if isinstance(t, AuthenticationThread)}


def run_link(keys: Path | None, body: Callable[[WorkerLink, Peer, list[Peer]], Awaitable[None]]) -> None:
    """A Curve link on tcp; two rogues (no keys; a stranger's keys) that know the
    worker's incarnation connect first, then the keyed worker. ``keys`` None: the
    control, a plaintext link (--insecure-plaintext-zmq) with one keyless rogue."""
    async def main() -> None:
        before = _auth_threads()
        link = WorkerLink(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                          worker_timeout=10, curve_keys=load_server_keys(keys) if keys else None,
                          insecure_plaintext=keys is None)
        ctx = zmq.asyncio.Context()
        incarnation = new_incarnation()
        peers = [Peer(ctx, link, None, incarnation)]
        if keys is not None:
            peers.append(Peer(ctx, link, _stranger(keys), incarnation))
        try:
            await asyncio.sleep(0.3)       # the rogues' handshakes have been tried
            peers.insert(0, Peer(ctx, link, load_client_keys(keys) if keys else None, incarnation))
            await asyncio.wait_for(body(link, peers[0], peers[1:]), 10)
        finally:
            for peer in peers:
                peer.close()
            ctx.term()
            link.close()
        assert _auth_threads() == before, "the ZAP authenticator outlived the link"
    asyncio.run(main())


async def _serve(link: WorkerLink, worker: Peer) -> None:
    waiting = asyncio.ensure_future(link.wait_ready())
    await worker.push.send(_ready(worker.incarnation, 4242))
    assert (await waiting).worker_pid == 4242


def test_plans_reach_the_keyed_worker_and_no_rogue(keys: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(link: WorkerLink, worker: Peer, rogues: list[Peer]) -> None:
        await _serve(link, worker)
        for step in range(1, 7):
            await link.send_plan(engine_pb2.StepPlan(step_id=step))
        got = [engine_pb2.SchedulerMessage.FromString(await worker.plans.recv()) for _ in range(6)]
        assert [m.plan.step_id for m in got] == [1, 2, 3, 4, 5, 6]
        for rogue in rogues:
            assert await rogue.got_nothing()

    with caplog.at_level(logging.INFO, logger="jitney.zmq_security"):
        run_link(keys, body)
    # The scheduler's allow-list refused the stranger, and the stranger was told so.
    assert "refused a ZeroMQ peer with an untrusted Curve key" in caplog.text
    assert "refused this worker's Curve key" in caplog.text


async def _forge(rogue: Peer, frame: bytes) -> None:
    """Send as a rogue can: with no handshake done its PUSH may have no pipe at
    all (zmq.Again), or queue the frame on one that is never connected."""
    try:
        await rogue.push.send(frame, zmq.DONTWAIT)
    except zmq.Again:
        pass


def test_forged_worker_messages_change_nothing(keys: Path) -> None:
    async def body(link: WorkerLink, worker: Peer, rogues: list[Peer]) -> None:
        for rogue in rogues:
            await _forge(rogue, _ready(rogue.incarnation, 666))
        await asyncio.sleep(0.5)
        assert not link.is_serving                     # a forged Ready serves no one
        await _serve(link, worker)
        await link.send_plan(engine_pb2.StepPlan(step_id=1))
        await worker.plans.recv()
        for rogue in rogues:
            for frame in (_result(worker.incarnation, 1, token=9), _ready(new_incarnation(), 666)):
                await _forge(rogue, frame)
        await asyncio.sleep(0.5)
        assert link.is_serving and link.worker_pid == 4242     # no "restart" by a forged Ready
        assert link._inbox.empty() and link.num_stale_frames == 0   # nothing even arrived
        await worker.push.send(_result(worker.incarnation, 1, token=7))
        assert list((await link.receive_result(1)).token_ids) == [7]   # the worker's, not token 9

    run_link(keys, body)


def test_control_without_curve_a_rogue_forges_a_result() -> None:
    """The same rogue on a plaintext link gets through: it took the worker's
    routing id first, so it reads the plans, and its forged result is taken.
    What the tests above show is Curve's doing, not the harness's."""
    async def body(link: WorkerLink, worker: Peer, rogues: list[Peer]) -> None:
        await _serve(link, worker)
        await link.send_plan(engine_pb2.StepPlan(step_id=1))
        assert engine_pb2.SchedulerMessage.FromString(await rogues[0].plans.recv()).plan.step_id == 1
        assert await worker.got_nothing()
        await rogues[0].push.send(_result(worker.incarnation, 1, token=9))
        assert list((await link.receive_result(1)).token_ids) == [9]   # forged, and taken

    run_link(None, body)


@pytest.mark.slow
def test_real_worker_over_curve(keys: Path, tmp_path: Path) -> None:
    """The worker process with --curve-keys on tcp: it is served and answers
    plans; a plain socket and a stranger's on the plan endpoint get nothing."""
    from tests.support.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")

    async def main() -> None:
        link = WorkerLink(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                          worker_timeout=30, curve_keys=load_server_keys(keys))
        ctx = zmq.asyncio.Context()
        rogues = [Peer(ctx, link, None, new_incarnation()), Peer(ctx, link, _stranger(keys), new_incarnation())]
        proc = subprocess.Popen(
            [sys.executable, "-m", "jitney.cli", "worker", "--model", str(model), "--num-blocks", "8",
             "--dtype", "float32", "--plan-addr", link.plan_addr, "--result-addr", link.result_addr,
             "--curve-keys", str(keys)], cwd=ROOT)
        try:
            ready = await asyncio.wait_for(link.wait_ready(), 120)
            assert ready.worker_pid == proc.pid
            for step in (1, 2, 3):
                result = await asyncio.wait_for(link.step(engine_pb2.StepPlan(step_id=step)), 30)
                assert result.step_id == step
            for rogue in rogues:
                assert await rogue.got_nothing(0.1)
            assert link.num_stale_frames == 0
            await link.send_shutdown()
            assert await asyncio.to_thread(proc.wait, 30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for rogue in rogues:
                rogue.close()
            ctx.term()
            link.close()
    asyncio.run(main())
