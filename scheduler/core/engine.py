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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.admission import AdmissionLimits
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.detokenizer import IncrementalDetokenizer
from jitney.scheduler.core.grammar import GrammarMatcher, fill_batch, forced_run, only_token
from jitney.scheduler.core.plan import sample_seed, to_step_plan
from jitney.scheduler.core.request import FinishReason, Request, RequestStatus
from jitney.scheduler.core.scheduler import Scheduler, SchedulerOutput
from jitney.scheduler.core.trace import StepTracer
from jitney.scheduler.core.request import ValidatedRequest
from jitney.scheduler.core.worker_link import StepDiscardedError, WorkerLink, WorkerLinkError

log = logging.getLogger("jitney.scheduler")
# Grammar jump-forward: the longest forced run one chunk carries (each token of a
# run costs the scheduler one mask computation, ~50 us here).
MAX_FORCED_RUN = 32


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
    # With finish_reason STOP_SEQUENCE: the stop string that matched.
    stop_sequence: str | None = None

    @property
    def is_last(self) -> bool:
        return self.stream_done or self.error is not None


@dataclass(eq=False)
class Sample:
    """One of a request's n samples: a scheduler Request of its own."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    matcher: GrammarMatcher | None = None   # constrained output: the grammar's state
    done: bool = False


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its id, its samples and the queue its events arrive on."""

    request_id: str
    samples: list[Sample]
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    done: bool = False
    deadline_timer: asyncio.TimerHandle | None = None
    # Prompt logprobs by position (1..P-1) as they arrive, until all are in.
    prompt_logprobs: dict[int, tuple[int, float, list[tuple[int, float]]]] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False

    @property
    def request(self) -> Request:
        """Sample 0's request (the only one when n = 1)."""
        return self.samples[0].request

    @property
    def detokenizer(self) -> IncrementalDetokenizer:
        return self.samples[0].detokenizer

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
                 admission: AdmissionLimits | None = None, pipeline_depth: int = 2,
                 vocab_size: int = 0) -> None:
        self.config = config
        self._eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size   # the model's logits width (grammar bitmasks)
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
        self.num_masked_steps = 0      # steps that sampled under grammar masks
        self.mask_seconds = 0.0        # time filling those masks (and finding forced runs)
        self.num_forced_tokens = 0     # tokens jump-forward planned without sampling them
        self._result_at: float | None = None   # when the latest result came in (speculation's overhead)
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
        arrival, prompt, parent = time.monotonic(), list(validated.prompt_token_ids), None
        samples = []
        for index in range(validated.sampling.n):
            req = Request(
                seq_id=next(self._seq_ids),
                prompt_token_ids=prompt,
                sampling=replace(validated.sampling, seed=sample_seed(validated.sampling.seed, index),
                                 prompt_logprobs=None if index else validated.sampling.prompt_logprobs),
                arrival_time=arrival,
                priority=validated.priority,
                cache_salt=validated.cache_salt,
                tenant=validated.tenant,
                parent=parent,
                sample_index=index,
            )
            if validated.lora is not None:
                req.lora_id, req.lora_name, req.lora_path = (validated.lora.lora_id, validated.lora.name,
                                                             validated.lora.path)
            parent = parent or req
            detok = IncrementalDetokenizer(self._tokenizer, prompt, validated.sampling.stop,
                                           keep_special=validated.keep_special)
            matcher = validated.grammar.new_matcher() if validated.grammar is not None else None
            # Drafts are not verified under a grammar: its masks would have to follow each draft.
            req.may_draft = matcher is None
            s = req.sampling
            req.may_jump = (matcher is not None and self.config.jump_forward and not validated.token_logprobs
                            and not req.penalised and not s.min_tokens and not s.top_logprobs)
            samples.append(Sample(index, req, detok, matcher))
        handle = RequestHandle(validated.request_id, samples)
        for sample in samples:
            self._handles[sample.request.seq_id] = handle
            self.scheduler.add_request(sample.request)
        limit = self.admission.time_limit(time_remaining)
        if limit is not None:
            handle.deadline_timer = asyncio.get_running_loop().call_later(
                max(0.0, limit), self._expire, handle)
        self._wakeup.set()
        return handle

    def _waiting_tokens(self) -> int:
        return sum(h.request.num_tokens for h in set(self._handles.values())
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
        for sample in handle.samples:
            self._handles.pop(sample.request.seq_id, None)
            if not sample.done:
                sample.done = True
                self.scheduler.abort_request(sample.request.seq_id, reason)
        self._wakeup.set()

    @property
    def num_active(self) -> int:
        """Requests in flight (a request's n samples count once)."""
        return len(set(self._handles.values()))

    # -- the loop ----------------------------------------------------------
    async def run(self) -> None:
        """Step until closed.

        Up to ``pipeline_depth`` plans are in flight: step N+1 is planned and
        sent while the worker runs step N, so the worker never waits for a
        plan. Its decodes use the tokens step N is still sampling (the worker
        fills them in); a request that step N finishes is learnt of one step
        late and its extra token is dropped. A failed step is recovered from
        (``_recover``). Raises WorkerLostError when the worker is gone.
        """
        in_flight: deque[tuple[SchedulerOutput, float, list[int]]] = deque()
        while not self._closed:
            if len(in_flight) < self._depth(in_flight):
                output = self.scheduler.schedule()
                if not output.is_empty:
                    started = self._tracer.now() if self._tracer else 0.0
                    plan = to_step_plan(output, self._eos_token_ids, self._is_masked,
                                        draft_model=self.config.speculative == "draft")
                    await self._link.send_plan(plan)
                    self._note_plan_sent(in_flight)
                    masked = [c.seq_id for c in plan.chunks if c.masked]
                    in_flight.append((output, started, masked))
                    if len(in_flight) == 1:
                        await self._send_masks(output.step_id, masked)
                    continue
            if in_flight:
                output, started, _ = in_flight.popleft()
                try:
                    result = await self._link.receive_result(output.step_id)
                except WorkerLinkError as exc:
                    await self._recover(output, [o for o, _, _ in in_flight], str(exc))
                    in_flight.clear()
                    continue
                self._result_at = time.perf_counter()
                self._apply(output, result, started)
                if in_flight:   # its masks needed this step's tokens: now they are in
                    await self._send_masks(in_flight[0][0].step_id, in_flight[0][2])
                continue
            if self.scheduler.has_work():
                log.error("requests are waiting but none can be scheduled")
            self._wakeup.clear()
            await self._wakeup.wait()

    def _depth(self, in_flight: deque[tuple[SchedulerOutput, float, list[int]]]) -> int:
        """Plans in flight allowed now: one while a step verifies drafts (how
        far its sequences got is known only from its result) or when the
        scheduler would draft once the steps in flight are in (drafts need
        every token known), else ``pipeline_depth``."""
        if self.scheduler.speculation is None or not in_flight:
            return self.pipeline_depth
        if any(c.num_draft_tokens or c.num_proposals for o, _, _ in in_flight for c in o.scheduled):
            return 1    # (a draft model's proposals come with that result)
        return 1 if self.scheduler.wants_to_draft() else self.pipeline_depth

    def _note_plan_sent(self, in_flight: deque[tuple[SchedulerOutput, float, list[int]]]) -> None:
        """With nothing else in flight, the worker idled from the last result
        to this plan: the pipelining a drafted step gives up (the rule's overhead)."""
        policy = self.scheduler.speculation
        if policy is not None and self._result_at is not None and len(in_flight) == 1:
            gap = time.perf_counter() - self._result_at
            policy.overhead_seconds = 0.9 * policy.overhead_seconds + 0.1 * gap
        self._result_at = None

    async def _recover(self, failed: SchedulerOutput, later: list[SchedulerOutput], message: str) -> None:
        """The worker failed step ``failed``: its requests end with INTERNAL.
        The steps planned after it (``later``, in flight) assumed it ran; the
        worker discards them until the next plan, which resets it. Every
        other running request is preempted and recomputes from its tokens so
        far (nothing streamed is lost or repeated); the replies of ``later``
        are read and dropped."""
        self._fail_step(failed, message)
        self.num_preemptions += self.scheduler.recover_from_failed_step([failed, *later])
        for output in later:
            try:
                await self._link.receive_result(output.step_id)
                log.warning("the worker ran step %d after step %d failed; its result is dropped",
                            output.step_id, failed.step_id)
            except StepDiscardedError:
                pass    # as expected
            except WorkerLinkError as exc:
                log.warning("after step %d failed: %s", failed.step_id, exc)

    def _apply(self, output: SchedulerOutput, result: engine_pb2.StepResult, started: float) -> None:
        """Hand a step's sampled tokens to the scheduler and the streams."""
        if self._tracer:
            samples = sum(c.sample for c in output.scheduled)
            self._tracer.record(output, started, result.worker_seconds, result.model_seconds,
                                self.scheduler, accepted_tokens=max(0, len(result.seq_ids) - samples))
        self.scheduler.observe_step_time(output, result.model_seconds)
        self.num_steps += 1
        self.num_preemptions += len(output.preempted)
        if self.on_step is not None:
            self.on_step(result.worker_seconds, len(output.scheduled))
        try:   # checks the whole result before it changes anything
            top = self._split_top_logprobs(output, result)
            updated = self.scheduler.update_from_output(
                output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        except ValueError as exc:
            self._fail_step(output, f"the worker's result of step {output.step_id} is unusable: {exc}")
            return
        if result.proposals or result.draft_proposed_tokens:
            self.scheduler.take_proposals([(p.seq_id, p.start_position, p.token_ids) for p in result.proposals],
                                          result.draft_seconds, result.draft_proposed_tokens)
        for entry in result.prompt_logprobs:
            self._collect_prompt_logprobs(entry)
        for req in updated:
            self._emit_guarded(req, top.get(req.seq_id, []))

    def _split_top_logprobs(self, output: SchedulerOutput, result: engine_pb2.StepResult
                            ) -> dict[int, list[list[tuple[int, float]]]]:
        """The result's flat top-logprobs arrays, per sampled sequence and token
        (a chunk with drafts has an entry per token it yielded)."""
        wanted = {c.request.seq_id: c.request.sampling.top_logprobs for c in output.scheduled if c.sample}
        top: dict[int, list[list[tuple[int, float]]]] = {}
        offset = 0
        for seq_id in result.seq_ids:
            n = wanted.get(seq_id, 0)
            if n:
                ids = result.top_token_ids[offset:offset + n]
                top.setdefault(seq_id, []).append(list(zip(ids, result.top_logprobs[offset:offset + n])))
                offset += n
        if offset != len(result.top_token_ids) or offset != len(result.top_logprobs):
            raise ValueError(f"{len(result.top_token_ids)} top logprobs for {offset} expected")
        return top

    def _collect_prompt_logprobs(self, entry: engine_pb2.PromptLogprobs) -> None:
        """Keep a chunk's prompt logprobs until the prompt's are all in."""
        handle = self._handles.get(entry.seq_id)
        if handle is None or handle.prompt_logprobs_sent or entry.seq_id != handle.request.seq_id:
            return
        n = handle.request.sampling.prompt_logprobs or 0
        for i, (token, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
            alternatives = list(zip(entry.top_token_ids[i * n:(i + 1) * n], entry.top_logprobs[i * n:(i + 1) * n]))
            handle.prompt_logprobs[entry.start_position + i] = (token, logprob, alternatives)
        if len(handle.prompt_logprobs) >= handle.request.num_prompt_tokens - 1:
            handle.request.prompt_logprobs_done = True

    def _is_masked(self, request: Request) -> bool:
        handle = self._handles.get(request.seq_id)
        return handle is not None and handle.samples[request.sample_index].matcher is not None

    async def _send_masks(self, step_id: int, seq_ids: list[int]) -> None:
        """The bitmasks of a step's masked chunks (``seq_ids``, as its plan
        marked them), from their grammar states after every token sampled
        before (the step runs meanwhile). A sample that ended since the plan
        was sent gets an all-ones row: its token will be dropped."""
        if not seq_ids:
            return
        words = -(-self._vocab_size // 32)
        bitmask = np.full((len(seq_ids), words), -1, dtype=np.int32)
        rows, matchers, requests = [], [], []
        for row, seq_id in enumerate(seq_ids):
            handle = self._handles.get(seq_id)
            if handle is None:
                continue
            sample = next(s for s in handle.samples if s.request.seq_id == seq_id)
            if sample.matcher is not None and not sample.request.is_finished:
                rows.append(row)
                matchers.append(sample.matcher)
                requests.append(sample.request)
        if matchers:
            # In parallel on the grammar engine's threads, off the event loop.
            started = time.perf_counter()
            filled = np.empty((len(matchers), words), dtype=np.int32)
            runs = await asyncio.to_thread(self._fill_masks, matchers, requests, filled)
            bitmask[rows] = filled
            for request, run in zip(requests, runs):
                if len(run) > 1 and not request.is_finished:
                    request.forced_token_ids, request.forced_step = run, step_id
                    self.num_forced_tokens += len(run) - 1
            self.mask_seconds += time.perf_counter() - started
        self.num_masked_steps += 1
        await self._link.send_masks(engine_pb2.StepMasks(
            step_id=step_id, seq_ids=seq_ids, bitmask=bitmask.astype("<i4", copy=False).tobytes()))

    def _fill_masks(self, matchers: list[GrammarMatcher], requests: list[Request],
                    out: np.ndarray) -> list[list[int]]:
        """``fill_batch``, then each jump-forward request's forced run (``grammar.forced_run``)
        where its mask allows one token: the run its next chunk may carry. Runs in a thread."""
        fill_batch(matchers, out)
        runs: list[list[int]] = []
        scratch = np.empty(out.shape[1], dtype=np.int32)
        for i, (matcher, request) in enumerate(zip(matchers, requests)):
            runs.append([])
            # One sample in flight (this step's): the run starts at its position.
            if not request.may_jump or request.num_pending_samples != 1 or request.forced_token_ids:
                continue
            first = only_token(out[i])
            if first is None:
                continue
            s = request.sampling
            # Room for the run and the sample after it, within max_tokens and the context.
            limit = min(MAX_FORCED_RUN, s.max_tokens - request.num_output_tokens - 1,
                        self.config.max_model_len - request.num_tokens - 1)
            stops = s.stop_token_ids | self._eos_token_ids    # (with ignore_eos too: EOS ends the grammar)
            runs[i] = forced_run(matcher, first, limit, stops, scratch)
        return runs

    def _emit_guarded(self, req: Request, top: list[list[tuple[int, float]]]) -> None:
        """``_emit``, but a failure ends that one request (INTERNAL), not the loop."""
        try:
            self._emit(req, top)
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
        for handle in set(self._handles.values()):
            self._end_with_error(handle, message)
        self._wakeup.set()

    # -- internals ---------------------------------------------------------
    def _emit(self, req: Request, top: list[list[tuple[int, float]]]) -> None:
        """The tokens the latest step gave ``req`` (1, or more with accepted
        drafts) to its stream, one at a time through the grammar and the stop
        strings, as they would have come one step each: a stop string that
        completes at a token ends the request there, and the tokens after it
        are dropped (from the request's output too)."""
        handle = self._handles.get(req.seq_id)
        if handle is None or handle.done:
            return
        sample = handle.samples[req.sample_index]
        count = req.last_step_tokens
        first = req.num_output_tokens - count
        text, emitted = "", 0
        for i in range(count):
            token = req.output_token_ids[first + i]
            emitted += 1
            if sample.matcher is not None and not (req.is_finished and i == count - 1):
                self._advance_grammar(sample, token)
            # Before min_tokens, stop strings are not matched (as stop ids are banned).
            update = sample.detokenizer.push([token], match_stop=first + i + 1 > req.sampling.min_tokens)
            text += update.text
            if update.stopped:
                if not req.is_finished:
                    self.scheduler.finish_request(req.seq_id, FinishReason.STOP_SEQUENCE)
                req.finish_reason = FinishReason.STOP_SEQUENCE
                break
        if emitted < count:   # a stop string ended it inside the step's tokens
            del req.output_token_ids[first + emitted:]
            del req.output_logprobs[first + emitted:]
        if req.is_finished and req.finish_reason is not FinishReason.STOP_SEQUENCE:
            text += sample.detokenizer.flush()
            if sample.detokenizer.stopped:   # the last characters completed a stop string
                req.finish_reason = FinishReason.STOP_SEQUENCE
        event = StreamEvent(token_ids=req.output_token_ids[first:first + emitted],
                            logprobs=req.output_logprobs[first:first + emitted], text=text,
                            sample_index=sample.index, top_logprobs=top[:emitted] if top else [])
        if req.sampling.prompt_logprobs is not None and not handle.prompt_logprobs_sent:
            event.prompt_logprobs = self._prompt_logprobs(handle)
            handle.prompt_logprobs_sent = True
        if req.is_finished:
            event.finish_reason = req.finish_reason
            if req.finish_reason == FinishReason.STOP_SEQUENCE:
                event.stop_sequence = sample.detokenizer.matched_stop
            sample.done = True
            del self._handles[req.seq_id]
            if all(s.done for s in handle.samples):
                event.stream_done = True
                event.prompt_tokens = req.num_prompt_tokens
                event.completion_tokens = sum(s.request.num_output_tokens for s in handle.samples)
                event.cached_prompt_tokens = handle.request.num_cached_tokens
                handle.done = True
        handle.events.put_nowait(event)

    def _advance_grammar(self, sample: Sample, token: int) -> None:
        """Feed the sampled token to the sample's grammar; a complete grammar ends it."""
        assert sample.matcher is not None
        req = sample.request
        if not sample.matcher.accept_token(token):
            raise RuntimeError(f"seq {req.seq_id}: token {token} breaks its grammar despite the mask")
        if sample.matcher.is_terminated() and not req.is_finished:
            self.scheduler.finish_request(req.seq_id, FinishReason.END_OF_SEQUENCE)

    def _prompt_logprobs(self, handle: RequestHandle) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        """The request's prompt logprobs, in prompt order (the first token has none)."""
        prompt = handle.request.prompt_token_ids
        got = handle.prompt_logprobs
        if len(got) < len(prompt) - 1:
            raise RuntimeError(f"seq {handle.request.seq_id}: {len(got)} prompt logprobs "
                               f"for {len(prompt) - 1} positions")
        first: tuple[int, float | None, list[tuple[int, float]]] = (prompt[0], None, [])
        return [first] + [(prompt[p], got[p][1], got[p][2]) for p in range(1, len(prompt))]

    def _fail_step(self, output: Any, message: str) -> None:
        log.error("%s; ending the %d requests of that step", message, len(output.scheduled))
        # Blocks registered for that step may never have been written.
        self.scheduler.block_manager.reset_prefix_cache()
        for chunk in output.scheduled:
            handle = self._handles.get(chunk.request.seq_id)
            if handle is not None and not handle.done:
                self._end_with_error(handle, "the worker failed to run this request's step",
                                     code="INTERNAL")

    def _end_with_error(self, handle: RequestHandle, message: str,
                        code: str = "UNAVAILABLE") -> None:
        self.cancel(handle, FinishReason.ABORTED)
        handle.events.put_nowait(StreamEvent(error=message, error_code=code))
