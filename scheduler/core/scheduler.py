"""The scheduler: who rides the next step. Policy only, no torch.

Every step: running requests first (decodes, then partial prefills), then
waiting requests board in order (priority desc, arrival, seq_id) while seats,
token budget and blocks last; boarding stops at the first that does not fit.
A running request that needs a block when none is free preempts the
lowest-priority, latest-arrived running request (possibly itself): its blocks
are freed and it is recomputed later. With ``--fairness tenant`` the
boarding request and the victim are chosen among tenants first
(fairness.py): the least-served tenant's head boards, the most-served
tenant's last is preempted.

    request state       in          blocks   worker knows it
    WAITING             _waiting    none     no (if preempted: freed in a plan)
    RUNNING             _running    table    yes once scheduled
    FINISHED            nowhere     none     no (freed in a plan)

``num_computed_tokens`` advances when a chunk is scheduled, not when its
result arrives, so the next step could be planned before that.

Prefix cache: a boarding request (new, or resumed after preemption) attaches
the longest cached prefix of its tokens in whole blocks and starts computing
past it; its first chunk re-sends the whole table (cached blocks first).
Blocks filled by this step's chunks are registered at the end of
``schedule``, after every preemption of the step, so only chunks that really
run register, and a block is attached at the earliest by the next step. The
worker runs steps in order, so the K/V a hit reads were written by then (this
holds also if step N+1 is planned while step N runs).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence

from jitney.scheduler.core.block_manager import BlockManager, cdiv
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.drafting import DraftingSteps
from jitney.scheduler.core.fair_steps import FairSteps, queue_key
from jitney.scheduler.core.fairness import TenantFairness
from jitney.scheduler.core.lora import LoraSlots
from jitney.scheduler.core.request import FinishReason, Request, RequestStatus
from jitney.scheduler.core.schedule_output import ScheduledChunk, SchedulerOutput
from jitney.scheduler.core.speculative import Drafter, ModelDrafter, SpeculationPolicy, make_drafter
from jitney.scheduler.core.step_cost import StepCostModel, chunk_keys

# --max-step-ms: where the decodes alone are predicted over the target, a
# step's prefill chunks may still add this share of their time.
PREFILL_SHARE = 0.25


__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput"]


class Scheduler(DraftingSteps, FairSteps):
    """Continuous-batching scheduler owning the logical KV cache (its steps'
    drafts: ``DraftingSteps``; fair share's choices: ``FairSteps``)."""

    def __init__(self, config: SchedulerConfig,
                 eos_token_ids: frozenset[int] = frozenset(), *,
                 drafter: Drafter | None = None, speculation: SpeculationPolicy | None = None) -> None:
        """``drafter`` and ``speculation`` replace the drafter and the rule of
        ``config.speculative`` (which must not be off): tests force drafts so."""
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          config.enable_prefix_caching, window=config.sliding_window)
        self._eos_token_ids = eos_token_ids
        self._waiting: list[Request] = []       # sorted by queue_key
        self._held: list[Request] = []          # n > 1 samples waiting for their parent's prompt
        self._running: list[Request] = []       # batch order (boarding order)
        self._requests: dict[int, Request] = {}  # waiting or running
        self._on_worker: set[int] = set()       # seq_ids the worker holds
        self._pending_freed: list[int] = []     # for the next plan
        self._step_id = 0
        self._batch_left = 0    # static/sequential: batch members yet to board
        self._reset_worker = False   # the next plan resets the worker (after a failed step)
        # Speculative decoding (speculative.py): the drafter, the load-adaptive
        # rule, and totals for metrics (drafts = chunks that verified drafts;
        # acceptance_counts[i] = drafts with i tokens accepted).
        if (drafter is not None or speculation is not None) and config.speculative == "off":
            raise ValueError("a drafter or a speculation policy needs config.speculative on")
        self._drafter = drafter or make_drafter(config.speculative)
        self.speculation = speculation or (SpeculationPolicy(config.num_speculative_tokens)
                                           if self._drafter is not None else None)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.acceptance_counts = [0] * (config.num_speculative_tokens + 1)
        # Measured model times -> t = a + b T + c K (step_cost.py), for --max-step-ms and the trace.
        self.step_cost = StepCostModel()
        self.fairness = (TenantFairness(dict(config.tenant_weights))
                         if config.fairness == "tenant" else None)
        self.lora = LoraSlots(config.max_loras)

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` if it cannot run."""
        if request.seq_id in self._requests:
            raise ValueError(f"seq_id {request.seq_id} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.block_ids:
            raise ValueError(f"seq {request.seq_id} is not a fresh waiting request")
        if not 0 < request.num_tokens <= self.config.max_model_len:
            raise ValueError(
                f"seq {request.seq_id}: prompt of {request.num_tokens} tokens, "
                f"must be 1..{self.config.max_model_len}")
        if request.lora_id and not self.config.max_loras:
            raise ValueError(f"seq {request.seq_id} asks for a LoRA adapter, the worker has no slots")
        self._requests[request.seq_id] = request
        if self.fairness is not None:
            self.fairness.arrive(request)
        if request.parent is not None:
            self._held.append(request)
        else:
            bisect.insort(self._waiting, request, key=queue_key)

    def abort_request(self, seq_id: int, reason: FinishReason) -> Request | None:
        """Finish a live request now and free its blocks; ``None`` if unknown."""
        request = self._requests.get(seq_id)
        if request is not None:
            self._finish(request, reason)
        return request

    def finish_request(self, seq_id: int, reason: FinishReason) -> Request | None:
        """Finish a request for a reason found outside (a stop string)."""
        return self.abort_request(seq_id, reason)

    def get_request(self, seq_id: int) -> Request | None:
        """The live (waiting or running) request with this id, if any."""
        return self._requests.get(seq_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._held)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        """Whether a schedule() call would have anything to send."""
        return bool(self._waiting or self._running or self._pending_freed or self._held or self._reset_worker)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step; advances the scheduled requests' progress."""
        self._step_id += 1
        output = SchedulerOutput(step_id=self._step_id, reset=self._reset_worker)
        self._reset_worker = False
        if self._held:
            self._release_held()
        self._schedule_running(output)
        if not output.preempted:   # boarding now would only thrash
            self._admit_waiting(output)
        if self._drafter is not None:
            self._add_drafts(output)
            if isinstance(self._drafter, ModelDrafter):
                self._ask_for_proposals(output)
        if self.config.max_step_ms and self.step_cost.ready:
            output.predicted_seconds = self.predict_step(output)
        output.freed_seq_ids, self._pending_freed = self._pending_freed, []
        for chunk in output.scheduled:
            self.block_manager.cache_full_blocks(chunk.request, chunk.start_position)
        return output

    def _release_held(self) -> None:
        """n > 1: samples whose parent computed its prompt in an earlier step
        (or left) join the queue; they board sharing the parent's blocks."""
        held, self._held = self._held, []
        for request in held:
            parent = request.parent
            assert parent is not None
            if parent.is_finished or parent.num_computed_tokens >= parent.num_prompt_tokens:
                bisect.insort(self._waiting, request, key=queue_key)
            else:
                self._held.append(request)

    def _prefix_for(self, request: Request) -> tuple[list[int], bool]:
        """Blocks a boarding request starts with, and whether they are shared
        from its running parent (else they are prefix-cache hits)."""
        parent = request.parent
        if (parent is not None and parent.status is RequestStatus.RUNNING
                and parent.num_computed_tokens >= request.num_prompt_tokens
                and not request.output_token_ids):
            # Full prompt blocks only, and the last token computed again: the
            # sample needs logits of its own (and writes its own last block).
            blocks = parent.block_ids[:(request.num_prompt_tokens - 1) // self.config.block_size]
            if self.block_manager.covers_window(blocks):   # the parent may have released its window
                return blocks, True
        if request.wants_prompt_logprobs:
            return [], False
        return self.block_manager.find_cached_prefix(request), False

    def _budget_left(self, output: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - output.num_batched_tokens

    def _schedule_running(self, output: SchedulerOutput) -> None:
        # Decodes first, so a long prefill chunk never stalls the riders.
        order = sorted(self._running, key=lambda r: _num_remaining(r) > 1)
        reserve = self._fair_reserve()
        for request in order:
            if request.status is not RequestStatus.RUNNING:
                continue    # preempted earlier in this step
            num_new = min(self._num_schedulable(request), self._budget_left(output))
            if (reserve is not None and num_new > 1 and request.tenant != reserve[0]
                    and not self._served_more(reserve[0], request.tenant)):
                # a prompt chunk of a more-served tenant leaves the boarding one its share of the step
                num_new = min(num_new, self._budget_left(output) - reserve[1])
            num_new = self._within_step_time(request.num_computed_tokens, num_new, output)
            if num_new <= 0:
                continue
            # Released with a chunk only: the worker learns of it from that chunk's start.
            self.block_manager.release_before_window(request)
            if self._make_room(request, num_new, output):
                self._schedule_chunk(request, num_new, output)

    def _num_schedulable(self, request: Request) -> int:
        """Tokens ``request`` can compute now; none once its pending samples end it."""
        if request.num_draft_tokens:
            return 0    # how far it got is known only from that chunk's result
        ahead = request.num_pending_samples + _num_forced_extra(request)
        if request.num_pending_samples and (request.num_output_tokens + ahead >= request.sampling.max_tokens
                                            or request.num_tokens + ahead >= self.config.max_model_len):
            return 0
        return _num_remaining(request)

    def _make_room(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Preempt until ``request``'s blocks fit; False if it was the victim."""
        needed = self.block_manager.blocks_needed(request, num_new)
        while not self.block_manager.can_allocate(needed):
            victim = self._victim()
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, output: SchedulerOutput) -> None:
        seats = self._boarding_seats()
        if not seats and self._fair_seat_taker() is not None:
            self._preempt(self._victim(), output)
            seats = 1
        # Requests whose adapter has no slot now: they wait, those behind them may board (lora.py).
        no_slot: list[Request] = []
        while len(self._waiting) > len(no_slot) and seats > 0 and self._budget_left(output) > 0:
            request = self._next_to_board(no_slot)
            if request.num_pending_samples:
                break   # preempted with a sample in flight: board once it is in
            if not self.lora.can_board(request.lora_id, output.lora_loads):
                no_slot.append(request)
                continue
            cached, shared = self._prefix_for(request)
            num_cached = len(cached) * self.config.block_size
            num_new = min(request.num_tokens - num_cached, self._budget_left(output))
            num_new = self._within_step_time(num_cached, num_new, output)
            if not num_new:
                break   # the step's time is spent (--max-step-ms)
            if not self.block_manager.can_board(cached, num_cached + num_new):
                break   # FCFS: nobody skips ahead
            self._waiting.remove(request)
            request.lora_slot = self.lora.board(request.lora_id, request.lora_name, request.lora_path,
                                                output.lora_loads)
            self._board(request, cached, shared)
            self._schedule_chunk(request, num_new, output)
            seats -= 1
            self._batch_left = max(0, self._batch_left - 1)

    def _board(self, request: Request, cached: list[int], shared: bool = False) -> None:
        """Seat a waiting request; it starts past its cached (or shared) prefix."""
        if shared:
            self.block_manager.share_blocks(request, cached)
        else:
            self.block_manager.attach_cached(request, cached)
        request.num_computed_tokens = len(cached) * self.config.block_size
        if request.num_preemptions == 0:    # usage reports the first boarding
            request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.RUNNING
        self._running.append(request)

    def _boarding_seats(self) -> int:
        """Seats open to waiting requests under the policy.

        static and sequential: when nothing rides, the next batch is formed
        from the head of the queue (all seats, or one); its members board as
        the token budget lets their prompts in, and nobody else boards until
        the whole batch has left.
        """
        if self.config.policy == "continuous":
            return self.config.max_num_seqs - len(self._running)
        if not self._running and not self._batch_left:
            size = self.config.max_num_seqs if self.config.policy == "static" else 1
            self._batch_left = min(size, len(self._waiting))
        return min(self._batch_left, self.config.max_num_seqs - len(self._running))

    def _schedule_chunk(self, request: Request, num_new: int, output: SchedulerOutput) -> None:
        start = request.num_computed_tokens
        # A sequence new to the worker gets its whole table, cached blocks too.
        table_len = len(request.block_ids) if request.seq_id in self._on_worker else 0
        self.block_manager.allocate_for(request, num_new)
        if request.seq_id not in self._on_worker:
            self._on_worker.add(request.seq_id)
            output.new_seqs.append(request)
        request.num_computed_tokens += num_new
        if self.fairness is not None:
            self.fairness.charge(request, start, num_new)
        # [start, num_tokens) known ids; [num_tokens, +pending) still sampling,
        # unless a grammar's forced run says what they hold (forced_token_ids)
        placeholder = start + num_new > request.num_tokens + len(request.forced_token_ids)
        sample = request.num_computed_tokens == (request.num_tokens + request.num_pending_samples
                                                 + _num_forced_extra(request))
        output.scheduled.append(ScheduledChunk(
            request=request, start_position=start, num_new_tokens=num_new,
            token_ids=_token_slice(request, start, num_new - placeholder),
            new_block_ids=request.block_ids[table_len:],
            sample=sample, last_token_from_sample=placeholder))
        request.num_pending_samples += sample
        output.num_batched_tokens += num_new

    # -- step time (--max-step-ms) --------------------------------------------
    def _within_step_time(self, start: int, num_new: int, output: SchedulerOutput) -> int:
        """A chunk of up to ``num_new`` tokens from position ``start``, cut so
        the step's predicted model time stays under ``max_step_ms`` while
        decodes ride it, or under ``1 + PREFILL_SHARE`` times the decodes'
        own predicted time where that is more (a target the decodes alone
        miss would otherwise leave prompts one block a step); the step's
        first prefill chunk keeps at least ``min_prefill_chunk`` tokens, so a
        prompt always advances. Unchanged when off, for one token, in a step
        without decodes, or before the cost model has measured ``min_steps``."""
        if num_new <= 1 or not self.config.max_step_ms or not self.step_cost.ready:
            return num_new
        window, chunks = self.config.sliding_window, output.scheduled
        decodes = [c for c in chunks if c.sample and c.num_new_tokens == 1]
        if not decodes:
            return num_new
        decode_time = self.step_cost.predict(
            len(decodes), sum(chunk_keys(c.start_position, 1, window) for c in decodes))
        limit = max(self.config.max_step_ms / 1000, (1 + PREFILL_SHARE) * decode_time)
        tokens, keys = output.num_batched_tokens, self._step_keys(output)

        def fits(n: int) -> bool:
            return self.step_cost.predict(tokens + n, keys + chunk_keys(start, n, window)) <= limit

        if fits(num_new):
            return num_new
        fit, over = 0, num_new       # the time grows with n: bisect for the largest that fits
        while over - fit > 1:
            mid = (fit + over) // 2
            fit, over = (mid, over) if fits(mid) else (fit, mid)
        if len(decodes) == len(chunks):    # the step's first prefill chunk
            fit = max(fit, min(num_new, self.config.min_prefill_chunk))
        return fit

    def predict_step(self, output: SchedulerOutput) -> float:
        """The step-cost model's model seconds for ``output``'s chunks."""
        return self.step_cost.predict(output.num_batched_tokens, self._step_keys(output))

    def _step_keys(self, output: SchedulerOutput) -> int:
        """Query-key pairs the attention of ``output``'s chunks computes."""
        window = self.config.sliding_window
        return sum(chunk_keys(c.start_position, c.num_new_tokens, window) for c in output.scheduled)

    # -- speculative decoding ------------------------------------------------
    def observe_step_time(self, output: SchedulerOutput, model_seconds: float) -> None:
        """A step's measured model time, for the rule's cost model and the step's.
        The rule prices a draft, a sampled row (the head and the sampler run
        for it, as a prefill token's do not), so it learns only from steps of
        decodes and verifications: a slope fitted across prefill chunks
        undercounted a draft by about 40% at 32 sequences (0.6 against 1.05 ms
        per token; spec-edit-32 all at once then drafted and ran 1.23x slower)."""
        if self.speculation is not None and all(c.num_new_tokens == 1 + c.num_draft_tokens
                                                for c in output.scheduled):
            self.speculation.cost.observe(output.num_batched_tokens, model_seconds)
        self.step_cost.observe(output.num_batched_tokens, model_seconds, self._step_keys(output))

    def _preempt(self, victim: Request, output: SchedulerOutput) -> None:
        self._unschedule(victim, output)
        self._requeue(victim)
        output.preempted.append(victim)

    def _requeue(self, victim: Request) -> None:
        """A running request back to waiting, its blocks freed: it will
        recompute its prompt and output so far."""
        self._running.remove(victim)
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        bisect.insort(self._waiting, victim, key=queue_key)

    def recover_from_failed_step(self, lost: Sequence[SchedulerOutput]) -> int:
        """The worker failed step ``lost[0]`` and discards the steps planned
        after it (``lost[1:]``) until a reset plan: none of them ran, so their
        samples never come, and every running request is preempted (it
        recomputes from its tokens so far; its output is kept). The next
        plan resets the worker, which forgets every sequence, so it frees
        none. The caller ends the failed step's own requests first. Returns
        the number of requests preempted."""
        for output in lost:
            for chunk in output.scheduled:
                chunk.request.num_pending_samples -= chunk.sample
                chunk.request.forced_token_ids, chunk.request.forced_step = [], 0   # its sample never comes
                if chunk.num_draft_tokens:
                    chunk.request.num_draft_tokens = 0
        preempted = len(self._running)
        for request in list(self._running):
            self._requeue(request)
        self._on_worker.clear()
        self._pending_freed.clear()
        self.lora.forget_loaded()    # the discarded plans' loads never ran
        self._batch_left = 0
        self._reset_worker = True
        return preempted

    def _unschedule(self, request: Request, output: SchedulerOutput) -> None:
        """Take back ``request``'s chunk of this step, if it has one."""
        chunk = next((c for c in output.scheduled if c.request is request), None)
        if chunk is not None:
            output.scheduled.remove(chunk)
            output.num_batched_tokens -= chunk.num_new_tokens
            request.num_pending_samples -= chunk.sample
            request.num_draft_tokens = 0
        if request in output.new_seqs:     # the worker never heard of it
            output.new_seqs.remove(request)
            self._on_worker.discard(request.seq_id)

    def update_from_output(self, output: SchedulerOutput, seq_ids: Sequence[int],
                           token_ids: Sequence[int],
                           logprobs: Sequence[float]) -> list[Request]:
        """Apply a step's sampled tokens; finish the requests that are done.

        ``seq_ids`` lists one entry per token: one for each sampling chunk of
        ``output``, in order, a chunk with drafts 1 + (drafts accepted)
        consecutive ones. Returns the requests that got tokens (finished or
        not; ``last_step_tokens`` says how many), in order; requests finished
        meanwhile (aborted, stop string) are skipped. A token that ends a
        request (EOS, a stop id, max_tokens) drops the ones after it.
        """
        runs = _result_runs(output, seq_ids)
        if len(token_ids) != len(seq_ids) or len(logprobs) != len(seq_ids):
            raise ValueError(f"step {output.step_id}: result does not match the plan")
        for chunk, begin, _ in runs:
            run = chunk.request.forced_token_ids
            if chunk.request.forced_step == output.step_id and run and token_ids[begin] != run[0]:
                raise ValueError(f"step {output.step_id}: seq {chunk.request.seq_id} sampled {token_ids[begin]} "
                                 f"where its grammar allowed only {run[0]}")
        updated: list[Request] = []
        for chunk, begin, end in runs:
            request = chunk.request
            request.num_pending_samples -= 1
            if chunk.num_draft_tokens:
                self._verified(chunk, end - begin - 1)
            forced: list[int] = []
            if request.forced_step == output.step_id:
                forced, request.forced_token_ids, request.forced_step = request.forced_token_ids[1:], [], 0
            if request.is_finished:
                continue    # finished a step late: these extra tokens are dropped
            request.last_step_tokens = 0
            # A forced run's tokens follow its first (sampled) one; nothing sampled them, so they have
            # no logprob (NaN): only requests that do not read logprobs jump (Request.may_jump).
            given = [*zip(token_ids[begin:end], logprobs[begin:end]), *((t, math.nan) for t in forced)]
            for token_id, logprob in given:
                request.output_token_ids.append(token_id)
                request.output_logprobs.append(logprob)
                request.last_step_tokens += 1
                reason = self._finish_reason(request, token_id)
                if reason is not None:
                    self._finish(request, reason)
                    break
            if chunk.num_draft_tokens and not request.is_finished:   # the accepted drafts' full blocks
                self.block_manager.cache_full_blocks(request, chunk.start_position + 1)
            updated.append(request)
        return updated

    def _finish_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """Why ``request`` stops after sampling ``token_id`` (kept in its output)."""
        sampling = request.sampling
        if token_id in sampling.stop_token_ids or (
                not sampling.ignore_eos and token_id in self._eos_token_ids):
            return FinishReason.END_OF_SEQUENCE
        if request.num_output_tokens >= sampling.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.CONTEXT_LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request in self._held:
            self._held.remove(request)
        else:
            self._waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.seq_id]
        if self.fairness is not None:
            self.fairness.leave(request)
        if self._drafter is not None and self.speculation is not None:
            self._drafter.forget(request.seq_id)
            self.speculation.forget(request.seq_id)

    def _release(self, request: Request) -> None:
        """Free the blocks and the adapter slot now; tell the worker in the next plan."""
        self.block_manager.free(request)
        self.lora.release(request.lora_slot)
        request.lora_slot = 0
        if request.seq_id in self._on_worker:
            self._on_worker.discard(request.seq_id)
            self._pending_freed.append(request.seq_id)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the scheduler's state is inconsistent."""
        self.block_manager.check_invariants()
        waiting_ids = {r.seq_id for r in self._waiting + self._held}
        running_ids = {r.seq_id for r in self._running}
        _check(not waiting_ids & running_ids, "a request is waiting and running")
        _check(waiting_ids | running_ids == set(self._requests), "lost a request")
        _check(len(self._running) <= self.config.max_num_seqs, "seats exceeded")
        _check(self._waiting == sorted(self._waiting, key=queue_key), "waiting out of order")
        _check(all(r.status is RequestStatus.WAITING and not r.block_ids
                   for r in self._waiting + self._held), "a waiting request holds blocks")
        _check(all(r.parent is not None for r in self._held), "a held request has no parent")
        _check(all(r.status is RequestStatus.RUNNING and len(r.block_ids) == cdiv(
            r.num_computed_tokens, self.config.block_size) for r in self._running),
            "a running request's table does not match its progress")
        self.lora.check_invariants(Counter(r.lora_slot for r in self._running if r.lora_slot))
        null = self.block_manager.null_block
        _check(all(null not in r.block_ids[self.block_manager.window_start(r.num_computed_tokens):]
                   for r in self._running), "a running request lost a block its window reads")
        refs = Counter(b for r in self._running for b in r.block_ids if b != null)
        _check(all(self.block_manager.ref_count(b) == n for b, n in refs.items())
               and len(refs) == self.block_manager.num_used_blocks,
               "ref counts do not match the block tables")


def _result_runs(output: SchedulerOutput, seq_ids: Sequence[int]) -> list[tuple[ScheduledChunk, int, int]]:
    """Each sampling chunk of ``output`` with its entries ``[begin, end)`` of a
    result's per-token ``seq_ids``; ``ValueError`` when they do not fit the plan."""
    runs, at, n = [], 0, len(seq_ids)
    for chunk in output.scheduled:
        if not chunk.sample:
            continue
        sid, end = chunk.request.seq_id, at
        while end < n and seq_ids[end] == sid and end - at <= chunk.num_draft_tokens:
            end += 1
        if end == at:
            raise ValueError(f"step {output.step_id}: result does not match the plan")
        runs.append((chunk, at, end))
        at = end
    if at != n:
        raise ValueError(f"step {output.step_id}: result does not match the plan")
    return runs


def _num_forced_extra(request: Request) -> int:
    """Positions a forced run adds past the pending sample it starts with."""
    return max(0, len(request.forced_token_ids) - 1)


def _num_remaining(request: Request) -> int:
    return (request.num_tokens + request.num_pending_samples + _num_forced_extra(request)
            - request.num_computed_tokens)


def _token_slice(request: Request, start: int, n: int) -> list[int]:
    """``all_token_ids[start:start + n]`` without copying the whole history; past
    ``num_tokens``, the forced run's tokens."""
    p = request.num_prompt_tokens
    ids = (request.prompt_token_ids[start:start + n]
           + request.output_token_ids[max(0, start - p):max(0, start + n - p)])
    t = request.num_tokens
    if request.forced_token_ids and start + n > t:
        ids += request.forced_token_ids[max(0, start - t):start + n - t]
    return ids


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
