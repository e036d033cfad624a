"""The scheduler process's ``serve`` in this process, over the scripted worker:
the security, fairness and door tests' server (real gRPC and HTTP doors, a
fake model)."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from jitney.client.channel import TlsFiles, open_channel
from jitney.common.model_files import load_tokenizer, resolve_model
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.main import SchedulerProcessConfig, serve
from jitney.v1 import generation_pb2_grpc as pb_grpc
from tests.support.scripted_worker import ScriptedWorker, serve_worker
from tests.support.security_keys import TIMEOUT
from tests.support.server_harness import free_port


class InProcessScheduler:
    """``serve(cfg)`` in a background loop, the scripted worker on its sockets."""

    def __init__(self, folder: Path, model: Path, client_tls: TlsFiles | None, *,
                 ready: engine_pb2.Ready | None = None, **fields: Any) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.tls = client_tls
        self.cfg = SchedulerProcessConfig(str(model), "127.0.0.1", self.port, None, None, "continuous",
                                          f"ipc://{folder}/plan", f"ipc://{folder}/result",
                                          openai_port=self.http_port, drain_seconds=1.0, **fields)
        tokenizer = load_tokenizer(resolve_model(model))
        self.worker = ScriptedWorker(tokenizer) if ready is None else ScriptedWorker(tokenizer, ready)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop: asyncio.Event | None = None
        self._channels: dict[tuple[str | None, TlsFiles | None], grpc.Channel] = {}
        self.served = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        deadline = time.monotonic() + 60
        while health_status(self.target, self.tls) != health_pb2.HealthCheckResponse.SERVING:
            assert not self.served.done(), f"serve() ended: {self.served.result()}"
            assert time.monotonic() < deadline, "the in-process scheduler is not SERVING"
            time.sleep(0.05)

    async def _run(self) -> int:
        self.stop = asyncio.Event()
        link = SimpleNamespace(plan_addr=self.cfg.plan_addr, result_addr=self.cfg.result_addr)
        worker = asyncio.create_task(serve_worker(link, self.worker))   # type: ignore[arg-type]
        try:
            return await serve(self.cfg, stop=self.stop, drain=asyncio.Event())
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    def stub(self, key: str | None = None, tls: TlsFiles | None | str = "same") -> pb_grpc.GenerationServiceStub:
        """A stub on a channel with ``key`` and ``tls`` (default: the server's own)."""
        how = (key, self.tls if isinstance(tls, str) else tls)
        if how not in self._channels:
            self._channels[how] = open_channel(self.target, tls=how[1], api_key=key)
        return pb_grpc.GenerationServiceStub(self._channels[how])

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.cfg.metrics_port}/metrics",
                                      timeout=TIMEOUT).read().decode()
        # The samples of ``name`` whose labels include ``labels``, summed.
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and labels.items() <= s.labels.items())

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        try:
            assert self.stop is not None
            self.loop.call_soon_threadsafe(self.stop.set)
            assert self.served.result(20) == 0
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def health_status(target: str, tls: TlsFiles | None, timeout: float = 2.0) -> int | None:
    with open_channel(target, tls=tls) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout).status
        except grpc.RpcError:
            return None
