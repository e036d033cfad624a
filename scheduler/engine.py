"""The scheduler process's engine loop: requests in, step plans out.

One asyncio task drives the worker: schedule a step, send its plan, await the
result, hand each sampled token to its request's stream. gRPC handlers only
``submit`` and ``cancel``; they never touch the scheduler between awaits of
the loop, so the scheduler needs no locks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.admission import AdmissionLimits
from jitney.scheduler.config import SchedulerConfig
from jitney.scheduler.detokenizer import IncrementalDetokenizer
from jitney.scheduler.plan import to_step_plan
from jitney.scheduler.request import FinishReason, Request, RequestStatus
from jitney.scheduler.scheduler import Scheduler, SchedulerOutput
from jitney.scheduler.trace import StepTracer
from jitney.scheduler.validation import ValidatedRequest
from jitney.scheduler.worker_link import WorkerLink, WorkerLinkError

log = logging.getLogger("jitney.scheduler")


class EngineUnavailableError(RuntimeError):
    """The engine cannot take the request now (worker gone, shutting down)."""


@dataclass
class StreamEvent:
    """What one step produced for one request.

    The last event of a request has ``finish_reason`` set (a normal end) or
    ``error`` set (the request was ended by the server).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str = "UNAVAILABLE"   # a grpc.StatusCode name, used with ``error``
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Which of the request's n samples this event belongs to; finish_reason
    # ends that sample, ``stream_done`` the whole request (usage then holds
    # the prompt once and the completion tokens of all samples).
    sample_index: int = 0
    stream_done: bool = False
    # Per token in token_ids: the top_logprobs most likely (id, logprob).
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # In a request's first event when prompt_logprobs was asked for: per
    # prompt token (id, logprob or None for the first, top alternatives).
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None

    @property
    def is_last(self) -> bool:
        return self.stream_done or self.error is not None


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its id and the queue its events arrive on."""

    request_id: str
    request: Request
    detokenizer: IncrementalDetokenizer
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    done: bool = False
    deadline_timer: asyncio.TimerHandle | None = None

    async def stream(self) -> AsyncIterator[StreamEvent]:
        while True:
            event = await self.events.get()
            yield event
            if event.is_last:
                return


class Engine:
    """Owns the Scheduler and the worker link for one ready worker."""

    def __init__(self, config: SchedulerConfig, link: WorkerLink, tokenizer: Any,
                 eos_token_ids: frozenset[int], tracer: StepTracer | None = None,
                 admission: AdmissionLimits | None = None, pipeline_depth: int = 2) -> None:
        self.config = config
        self.pipeline_depth = pipeline_depth   # plans in flight at once (1 = no overlap)
        self.admission = admission or AdmissionLimits()
        self.scheduler = Scheduler(config, eos_token_ids=eos_token_ids)
        self._link = link
        self._tokenizer = tokenizer
        self._handles: dict[int, RequestHandle] = {}
        self._seq_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._tracer = tracer
        self._closed = False
        self.num_steps = 0
        self.num_preemptions = 0
        # Called after each step with (worker seconds, sequences scheduled): metrics.
        self.on_step: Callable[[float, int], None] | None = None

    # -- called by the gRPC handlers -------------------------------------
    def submit(self, validated: ValidatedRequest,
               time_remaining: float | None = None) -> RequestHandle:
        """Queue a request. Raises EngineUnavailableError (closed) or
        QueueFullError (a queue bound); ``time_remaining`` is the call's
        deadline in seconds from now (None: none), capped by the server's."""
        if self._closed:
            raise EngineUnavailableError("the engine is shutting down")
        self.admission.check(self.scheduler.num_waiting, self._waiting_tokens(),
                             len(validated.prompt_token_ids))
        req = Request(
            seq_id=next(self._seq_ids),
            prompt_token_ids=list(validated.prompt_token_ids),
            sampling=validated.sampling,
            arrival_time=time.monotonic(),
            priority=validated.priority,
            cache_salt=validated.cache_salt,
        )
        detok = IncrementalDetokenizer(self._tokenizer, req.prompt_token_ids, validated.sampling.stop)
        handle = RequestHandle(validated.request_id, req, detok)
        self._handles[req.seq_id] = handle
        self.scheduler.add_request(req)
        limit = self.admission.time_limit(time_remaining)
        if limit is not None:
            handle.deadline_timer = asyncio.get_running_loop().call_later(
                max(0.0, limit), self._expire, handle)
        self._wakeup.set()
        return handle

    def _waiting_tokens(self) -> int:
        return sum(h.request.num_tokens for h in self._handles.values()
                   if h.request.status is RequestStatus.WAITING)

    def _expire(self, handle: RequestHandle) -> None:
        """The request's deadline passed: free its blocks, end it."""
        if not handle.done:
            self._end_with_error(handle, "the request's deadline passed before it finished",
                                 code="DEADLINE_EXCEEDED")

    def cancel(self, handle: RequestHandle, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End a request early; its blocks are freed now, the worker forgets it next step."""
        if handle.deadline_timer is not None:
            handle.deadline_timer.cancel()
        if handle.done:
            return
        handle.done = True
        self._handles.pop(handle.request.seq_id, None)
        self.scheduler.abort_request(handle.request.seq_id, reason)
        self._wakeup.set()

    @property
    def num_active(self) -> int:
        return len(self._handles)

    # -- the loop ----------------------------------------------------------
    async def run(self) -> None:
        """Step until closed.

        Up to ``pipeline_depth`` plans are in flight: step N+1 is planned and
        sent while the worker runs step N, so the worker never waits for a
        plan. Its decodes use the tokens step N is still sampling (the worker
        fills them in); a request that step N finishes is learnt of one step
        late and its extra token is dropped. Raises WorkerLostError when the
        worker is gone.
        """
        in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        while not self._closed:
            if len(in_flight) < self.pipeline_depth:
                output = self.scheduler.schedule()
                if not output.is_empty:
                    started = self._tracer.now() if self._tracer else 0.0
                    await self._link.send_plan(to_step_plan(output))
                    in_flight.append((output, started))
                    continue
            if in_flight:
                output, started = in_flight.popleft()
                try:
                    result = await self._link.receive_result(output.step_id)
                except WorkerLinkError as exc:
                    self._fail_step(output, str(exc))
                    continue
                self._apply(output, result, started)
                continue
            if self.scheduler.has_work():
                log.error("requests are waiting but none can be scheduled")
            self._wakeup.clear()
            await self._wakeup.wait()

    def _apply(self, output: SchedulerOutput, result: engine_pb2.StepResult, started: float) -> None:
        """Hand a step's sampled tokens to the scheduler and the streams."""
        if self._tracer:
            self._tracer.record(output, started, result.worker_seconds, result.model_seconds,
                                self.scheduler)
        self.num_steps += 1
        self.num_preemptions += len(output.preempted)
        if self.on_step is not None:
            self.on_step(result.worker_seconds, len(output.scheduled))
        try:   # checks the whole result before it changes anything
            updated = self.scheduler.update_from_output(
                output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        except ValueError as exc:
            self._fail_step(output, f"the worker's result of step {output.step_id} is unusable: {exc}")
            return
        for req in updated:
            self._emit_guarded(req)

    def _emit_guarded(self, req: Request) -> None:
        """``_emit``, but a failure ends that one request (INTERNAL), not the loop."""
        try:
            self._emit(req)
        except Exception:
            log.exception("handling the result of request seq %d failed; ending it", req.seq_id)
            handle = self._handles.get(req.seq_id)
            if handle is not None:
                self._end_with_error(handle, "internal error while handling this request's output",
                                     code="INTERNAL")

    def close(self, message: str) -> None:
        """End every request with ``message`` and stop the loop."""
        self._closed = True
        if self._tracer is not None:
            self._tracer.flush()    # the process closes it; a restarted worker's engine appends
        for handle in list(self._handles.values()):
            self._end_with_error(handle, message)
        self._wakeup.set()

    # -- internals ---------------------------------------------------------
    def _emit(self, req: Request) -> None:
        handle = self._handles.get(req.seq_id)
        if handle is None or handle.done:
            return
        token = req.output_token_ids[-1]
        update = handle.detokenizer.push([token])
        text = update.text
        if update.stopped and not req.is_finished:
            self.scheduler.finish_request(req.seq_id, FinishReason.STOP_SEQUENCE)
        elif req.is_finished:
            text += handle.detokenizer.flush()
            if handle.detokenizer.stopped:   # the last characters completed a stop string
                req.finish_reason = FinishReason.STOP_SEQUENCE
        event = StreamEvent(token_ids=[token], logprobs=[req.output_logprobs[-1]], text=text)
        if req.is_finished:
            event.finish_reason = req.finish_reason
            event.prompt_tokens = req.num_prompt_tokens
            event.completion_tokens = req.num_output_tokens
            event.cached_prompt_tokens = req.num_cached_tokens
            event.stream_done = True
            handle.done = True
            del self._handles[req.seq_id]
        handle.events.put_nowait(event)

    def _fail_step(self, output: Any, message: str) -> None:
        log.error("%s; ending the %d requests of that step", message, len(output.scheduled))
        # Blocks registered for that step may never have been written.
        self.scheduler.block_manager.reset_prefix_cache()
        for chunk in output.scheduled:
            handle = self._handles.get(chunk.request.seq_id)
            if handle is not None:
                self._end_with_error(handle, "the worker failed to run this request's step",
                                     code="INTERNAL")

    def _end_with_error(self, handle: RequestHandle, message: str,
                        code: str = "UNAVAILABLE") -> None:
        self.cancel(handle, FinishReason.ABORTED)
        handle.events.put_nowait(StreamEvent(error=message, error_code=code))
