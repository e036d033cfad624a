"""A fault-injection soak against a running `jitney serve` (used by
tests/e2e/test_soak.py and, longer, by bench/soak.py).

Client threads send a mix of calls: greedy streams read to the end, streams
cancelled at a random point, calls with short deadlines, invalid requests and
bursts of unary calls beyond the queue bound, while a killer thread SIGKILLs
the worker process a number of times (waiting for the server to serve again
in between). Each call ends in exactly one outcome, checked against what its
kind allows; greedy outputs (complete, or cut short by a worker loss) are
checked against a fault-free reference run of the same request alone.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from jitney.v1 import generation_pb2 as pb
from jitney.client.client import Sampling, make_params
from tests.support.server_harness import Server, health_status

FINISHED = "finished"
SC = grpc.StatusCode
ALLOWED: dict[str, set[str]] = {
    "greedy": {FINISHED, SC.UNAVAILABLE.name, SC.RESOURCE_EXHAUSTED.name},
    "cancel": {"cancelled", FINISHED, SC.UNAVAILABLE.name, SC.RESOURCE_EXHAUSTED.name},
    "deadline": {SC.DEADLINE_EXCEEDED.name, SC.UNAVAILABLE.name, SC.RESOURCE_EXHAUSTED.name},
    "invalid": {SC.INVALID_ARGUMENT.name, SC.UNAVAILABLE.name},
    "burst": {FINISHED, SC.UNAVAILABLE.name, SC.RESOURCE_EXHAUSTED.name},
}


@dataclass(frozen=True)
class GreedyJob:
    prompt: tuple[int, ...]
    max_tokens: int

    def params(self) -> pb.GenerationParams:
        return make_params(list(self.prompt), sampling=Sampling(max_tokens=self.max_tokens,
                                                                ignore_eos=True))


def greedy_jobs(n: int, seed: int = 0) -> list[GreedyJob]:
    rng = random.Random(seed)
    return [GreedyJob(tuple(rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))),
                      rng.randrange(8, 60)) for _ in range(n)]


def stream_tokens(server: Server, params: pb.GenerationParams, timeout: float = 60) -> list[int]:
    msgs = server.stub().GenerateStream(pb.GenerateStreamRequest(params=params), timeout=timeout)
    return [t for m in msgs for t in m.token_ids]


@dataclass
class Outcome:
    kind: str
    result: str                 # FINISHED, "cancelled" or a status code name
    tokens: list[int] = field(default_factory=list)
    job: GreedyJob | None = None
    problem: str | None = None  # a broken rule, found while the call ran


class Soak:
    def __init__(self, server: Server, jobs: list[GreedyJob], reference: dict[GreedyJob, list[int]],
                 seed: int = 1) -> None:
        self.server = server
        self.jobs = jobs
        self.reference = reference
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.kills: list[int] = []
        self.recoveries: list[float] = []   # seconds from each kill to a new worker SERVING

    # -- one call of each kind -------------------------------------------
    def _stream(self, kind: str, params: pb.GenerationParams, timeout: float,
                cancel_after: int | None = None, job: GreedyJob | None = None) -> Outcome:
        call = self.server.stub().GenerateStream(pb.GenerateStreamRequest(params=params),
                                                 timeout=timeout)
        out = Outcome(kind, "", job=job)
        finished_seen = False
        try:
            for msg in call:
                if finished_seen:
                    out.problem = "a message after the finishing one"
                out.tokens += msg.token_ids
                if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    finished_seen = True
                    if msg.usage.completion_tokens != len(out.tokens):
                        out.problem = f"usage {msg.usage.completion_tokens} != {len(out.tokens)} tokens"
                if cancel_after is not None and len(out.tokens) >= cancel_after:
                    call.cancel()
            out.result = FINISHED if finished_seen else "ended without a finish reason"
        except grpc.RpcError as err:
            code = err.code()
            out.result = "cancelled" if code == SC.CANCELLED and cancel_after is not None else code.name
            if finished_seen and out.result != "cancelled":
                out.problem = f"status {code.name} after the finishing message"
        return out

    def greedy(self) -> Outcome:
        job = self.rng.choice(self.jobs)
        return self._stream("greedy", job.params(), 60, job=job)

    def cancel(self) -> Outcome:
        params = make_params([5, 6, 7], sampling=Sampling(max_tokens=300, ignore_eos=True))
        return self._stream("cancel", params, 60, cancel_after=self.rng.randrange(1, 40))

    def deadline(self) -> Outcome:
        params = make_params([8, 9], sampling=Sampling(max_tokens=500, ignore_eos=True))
        return self._stream("deadline", params, self.rng.uniform(0.05, 0.4))

    def invalid(self) -> Outcome:
        params = make_params([1, 2], sampling=Sampling(max_tokens=4, top_p=self.rng.choice([0.0, 2.0])))
        return self._stream("invalid", params, 10)

    def burst(self, n: int = 24) -> list[Outcome]:
        stub = self.server.stub()
        params = make_params([4, 4, 4], sampling=Sampling(max_tokens=30, ignore_eos=True))
        futures = [stub.Generate.future(pb.GenerateRequest(params=params), timeout=60)
                   for _ in range(n)]
        outs = []
        for f in futures:
            try:
                reply = f.result()
                outs.append(Outcome("burst", FINISHED, list(reply.token_ids)))
            except grpc.RpcError as err:
                outs.append(Outcome("burst", err.code().name))
        return outs

    # -- the run -----------------------------------------------------------
    def _client(self, stop: Callable[[], bool], max_calls: int) -> None:
        kinds = [self.greedy] * 5 + [self.cancel] * 2 + [self.deadline] * 2 + [self.invalid]
        for i in range(max_calls):
            if stop():
                return
            outs = self.burst() if i % 10 == 9 else [self.rng.choice(kinds)()]
            with self.lock:
                self.outcomes += outs
            unavailable = any(o.result == SC.UNAVAILABLE.name for o in outs)
            time.sleep(0.3 if unavailable else self.rng.uniform(0, 0.05))   # a client's backoff

    def _killer(self, kills: int | None, warmup: float, between: float | tuple[float, ...],
                duration: float | None) -> None:
        """SIGKILL the serving worker ``kills`` times, or until ``duration`` s
        have passed; each time wait until a new worker serves (timed into
        ``recoveries``), then let the load run ``between`` s (a tuple: its
        values in turn)."""
        pauses = between if isinstance(between, tuple) else (between,)
        time.sleep(warmup)
        started = time.monotonic()
        while (kills is None or len(self.kills) < kills) and \
                (duration is None or time.monotonic() - started < duration):
            pid = wait_serving(self.server).worker_pid
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            self.kills.append(pid)
            wait_until(lambda: self.server_stats_pid() not in (None, 0, pid)
                       and health_status(self.server.target) == health_pb2.HealthCheckResponse.SERVING, 90)
            self.recoveries.append(time.monotonic() - killed)
            time.sleep(pauses[(len(self.kills) - 1) % len(pauses)])

    def server_stats_pid(self) -> int | None:
        try:
            return self.server.stats().worker_pid
        except grpc.RpcError:
            return None

    def run(self, clients: int = 12, kills: int | None = 2, warmup: float = 1.0,
            between: float | tuple[float, ...] = 1.5,
            tail: float = 1.0, max_calls_per_client: int = 60, duration: float | None = None) -> Counter[str]:
        """Load from ``clients`` threads while the worker is killed ``kills``
        times (None: no limit) or for ``duration`` s, then ``tail`` s more."""
        killer = threading.Thread(target=self._killer, args=(kills, warmup, between, duration))
        killer.start()
        killer_done_at: list[float] = []

        def stop() -> bool:
            if not killer.is_alive() and not killer_done_at:
                killer_done_at.append(time.monotonic())
            return bool(killer_done_at) and time.monotonic() > killer_done_at[0] + tail

        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(self._client, stop, max_calls_per_client) for _ in range(clients)]:
                f.result()
        killer.join()
        counts = Counter(f"{o.kind}:{o.result}" for o in self.outcomes)
        counts["cut short by a worker loss, tokens kept"] = sum(
            1 for o in self.outcomes if o.result == SC.UNAVAILABLE.name and o.tokens)
        return counts

    def problems(self) -> list[str]:
        """Every broken rule among the outcomes."""
        found = []
        for o in self.outcomes:
            if o.problem:
                found.append(f"{o.kind}: {o.problem}")
            if o.result not in ALLOWED[o.kind]:
                found.append(f"{o.kind}: unexpected outcome {o.result}")
            if o.job is not None:
                ref = self.reference[o.job]
                if o.result == FINISHED and o.tokens != ref:
                    found.append(f"greedy output differs from the fault-free run: {o.job}")
                if o.result != FINISHED and o.tokens != ref[:len(o.tokens)]:
                    found.append(f"greedy tokens before {o.result} are not a prefix of the reference")
            if o.result in (SC.RESOURCE_EXHAUSTED.name, SC.INVALID_ARGUMENT.name) and o.tokens:
                found.append(f"{o.kind}: tokens before a rejection")
        return found


def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


def wait_serving(server: Server, timeout: float = 90) -> pb.GetServerStatsResponse:
    wait_until(lambda: health_status(server.target) == health_pb2.HealthCheckResponse.SERVING,
               timeout)
    return server.stats()


def wait_drained(server: Server, timeout: float = 20) -> pb.GetServerStatsResponse:
    def idle() -> bool:
        s = server.stats()
        return s.kv_blocks_used == 0 and s.requests_running == 0 and s.requests_waiting == 0
    wait_until(idle, timeout)
    return server.stats()
