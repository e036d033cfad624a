"""The scheduler's real pieces in a background event loop of the test process, with
both client doors: GenerationServicer and its ServingState, Lifecycle, Engine,
validation, WorkerLink on ZeroMQ ipc sockets, the OpenAI door's aiohttp app and a
gRPC server, and a scripted worker on the other end of the sockets
(``tests/support/scripted_worker.py``). Used by tests/scheduler/test_openai_api.py
and test_chat_template_kwargs.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import openai

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.api.http.app import OpenAIServer
from jitney.scheduler.api.servicer import GenerationServicer
from jitney.scheduler.core.worker_link import WorkerLink
from jitney.scheduler.lifecycle import Lifecycle
from jitney.scheduler.main import SchedulerProcessConfig, _make_engine
from jitney.v1 import generation_pb2_grpc as pb_grpc
from tests.support.scripted_worker import READY, ScriptedWorker, serve_worker
from tests.support.waiting import wait_for


async def _no_health(status: int) -> None:
    return None


class Harness:
    """What `jitney scheduler --openai-port` runs, minus signals: the OpenAI door
    (``client``) and the gRPC door (``stub``) over one servicer."""

    def __init__(self, tmp: Path, tokenizer: Any, *, max_queued: int = 2,
                 ready: engine_pb2.Ready = READY, jump_forward: bool = True) -> None:
        self.max_queued = max_queued
        self.jump_forward = jump_forward
        self.tokenizer = tokenizer
        self.worker = ScriptedWorker(tokenizer, ready)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start(tmp))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                                    max_retries=0, timeout=20)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 20) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, tmp: Path) -> None:
        self.link = WorkerLink(f"ipc://{tmp}/plan", f"ipc://{tmp}/result", worker_timeout=30)
        self.servicer = GenerationServicer()
        self.http = OpenAIServer(self.servicer)
        self.port = await self.http.start("127.0.0.1", 0)
        self.grpc = grpc.aio.server()
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.grpc)
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        await self.grpc.start()
        cfg = SchedulerProcessConfig(None, "127.0.0.1", 0, None, None, "continuous",
                                     self.link.plan_addr, self.link.result_addr,
                                     max_queued_requests=self.max_queued, jump_forward=self.jump_forward)
        self.stop = asyncio.Event()
        self.life = Lifecycle(self.link, self.servicer, _no_health,
                              lambda ready: _make_engine(cfg, self.link, self.tokenizer, ready, None),
                              self.tokenizer, "test", 2.0, self.stop, asyncio.Event())
        self.life_task = asyncio.create_task(self.life.run())
        self.worker_task: asyncio.Task[None] | None = None

    def start_worker(self) -> None:
        async def spawn() -> None:
            self.worker_task = asyncio.create_task(serve_worker(self.link, self.worker))
        self.call(spawn())
        wait_for(lambda: self.servicer.state is not None, timeout=10.0, interval=0.01)

    def set_refusing(self, reason: str | None) -> None:
        async def set_it() -> None:
            self.servicer.refusing = reason
        self.call(set_it())

    def engine_load(self) -> tuple[int, int, int, int]:
        """Requests in flight, running, waiting, and KV blocks held."""
        async def read() -> tuple[int, int, int, int]:
            assert self.servicer.state is not None
            engine = self.servicer.state.engine
            sched = engine.scheduler
            return (engine.num_active, sched.num_running, sched.num_waiting,
                    sched.block_manager.num_used_blocks)
        return self.call(read())  # type: ignore[no-any-return]

    def failures(self, code: str, door: str = "grpc") -> float:
        value = self.servicer.metrics.registry.get_sample_value("jitney:request_failure_total",
                                                                {"code": code, "door": door})
        return value or 0.0

    def close(self) -> None:
        async def stop() -> None:
            self.stop.set()
            await asyncio.wait_for(self.life_task, 10)
            await self.http.stop()
            await self.grpc.stop(None)
            if self.worker_task is not None:
                self.worker_task.cancel()
                await asyncio.gather(self.worker_task, return_exceptions=True)
            self.link.close()
        try:
            self.client.close()
            self.channel.close()
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@contextmanager
def text_worker_harness(folder: Path, tokenizer: Any, *, jump_forward: bool = True) -> Iterator[Harness]:
    """A Harness whose worker writes a chosen text (``TextWorker``), started and
    closed around the block: the tool and reasoning door tests' server."""
    from tests.support.text_worker import TextWorker

    harness = Harness(folder, tokenizer, jump_forward=jump_forward)
    harness.worker = TextWorker(tokenizer)
    try:
        harness.start_worker()
        yield harness
    finally:
        harness.close()

