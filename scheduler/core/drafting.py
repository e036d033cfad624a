"""The scheduler's speculative-decoding part of a step: which decodes verify
drafts and how many (the rule, ``speculative.SpeculationPolicy``), the drafts
added to their chunks, the draft model's proposals asked for and taken, and a
verified chunk rolled back to what was accepted. A mixin of ``Scheduler``:
the state it reads is the scheduler's own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jitney.scheduler.core.block_manager import BlockManager, cdiv
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.request import Request
from jitney.scheduler.core.schedule_output import ScheduledChunk, SchedulerOutput
from jitney.scheduler.core.speculative import DraftCandidate, Drafter, ModelDrafter, SpeculationPolicy


class DraftingSteps:
    """Drafting, verification and proposals, on the scheduler's state."""

    config: SchedulerConfig
    block_manager: BlockManager
    speculation: SpeculationPolicy | None
    _drafter: Drafter | None
    _requests: dict[int, Request]
    _running: list[Request]
    acceptance_counts: list[int]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    if TYPE_CHECKING:
        def _budget_left(self, output: SchedulerOutput) -> int: ...

    def _draft_cap(self, chunk: ScheduledChunk) -> int:
        """Drafts this step's ``chunk`` may verify: never past max_tokens nor
        the context (it yields up to 1 + drafts tokens); 0 unless it is the
        decode of a request whose every token is known (its only pending
        sample is this chunk's), not under a grammar."""
        request = chunk.request
        if (not request.may_draft or not chunk.sample or chunk.num_new_tokens != 1
                or chunk.last_token_from_sample or request.num_pending_samples != 1
                or not request.num_output_tokens or chunk.start_position != request.num_tokens - 1):
            return 0
        return max(0, min(self.config.num_speculative_tokens,
                          request.sampling.max_tokens - request.num_output_tokens - 1,
                          self.config.max_model_len - request.num_tokens - 1))

    def _add_drafts(self, output: SchedulerOutput) -> None:
        """Extend this step's decodes with drafts, as the rule allows, from
        the budget the step left (drafts never preempt nor stop a boarding)."""
        budget = self._budget_left(output)
        assert self._drafter is not None and self.speculation is not None
        if budget <= 0:
            return
        candidates, chunks = [], {}
        num_sampled = sum(c.sample for c in output.scheduled)
        for chunk in output.scheduled:
            request, cap = chunk.request, self._draft_cap(chunk)
            if cap and not self.speculation.worth_drafting(request.seq_id, output.num_batched_tokens, num_sampled):
                cap = 0     # not even one draft would pay: no proposal asked for
            proposal = self._drafter.propose(request, cap) if cap else []
            if proposal:
                candidates.append(DraftCandidate(request.seq_id, proposal))
                chunks[request.seq_id] = chunk
        if not candidates:
            return
        lengths = self.speculation.draft_lengths(candidates, output.num_batched_tokens, num_sampled, budget)
        for candidate in candidates:
            k = lengths.get(candidate.seq_id, 0)
            if k:
                self._extend_with_drafts(chunks[candidate.seq_id], candidate.proposal[:k], output)

    def _extend_with_drafts(self, chunk: ScheduledChunk, drafts: list[int], output: SchedulerOutput) -> None:
        request, k = chunk.request, len(drafts)
        if not self.block_manager.can_allocate(self.block_manager.blocks_needed(request, k)):
            return
        table_len = len(request.block_ids)
        self.block_manager.allocate_for(request, k)
        chunk.new_block_ids = chunk.new_block_ids + request.block_ids[table_len:]
        chunk.token_ids = chunk.token_ids + drafts
        chunk.num_new_tokens += k
        chunk.num_draft_tokens = k
        request.num_computed_tokens += k
        request.num_draft_tokens = k
        output.num_batched_tokens += k

    def _ask_for_proposals(self, output: SchedulerOutput) -> None:
        """Draft model: the samples of this step the worker drafts for after it,
        where the rule says a draft would pay (its cost included), as many as the
        next step could verify."""
        assert self.speculation is not None
        num_sampled = sum(c.sample for c in output.scheduled)
        for chunk in output.scheduled:
            request = chunk.request
            k = min(self.config.num_speculative_tokens,
                    request.sampling.max_tokens - request.num_output_tokens - request.num_pending_samples - 1,
                    self.config.max_model_len - request.num_tokens - request.num_pending_samples - 1)
            if (chunk.sample and request.may_draft and k > 0
                    and self.speculation.worth_drafting(request.seq_id, output.num_batched_tokens, num_sampled)):
                chunk.num_proposals = k

    def take_proposals(self, proposals: Sequence[tuple[int, int, Sequence[int]]], seconds: float,
                       num_tokens: int) -> None:
        """Draft model: a step's (seq id, start, tokens) proposals, for the live
        requests, and the draft's time (the rule's cost)."""
        if not isinstance(self._drafter, ModelDrafter) or self.speculation is None:
            return
        for seq_id, start, tokens in proposals:
            if seq_id in self._requests:
                self._drafter.receive(seq_id, start, tokens)
        self.speculation.observe_draft(seconds, num_tokens)

    def wants_to_draft(self) -> bool:
        """Whether a running request would likely verify drafts in a step
        planned once the steps in flight are in (the engine then waits for
        them: drafts need every token known). Judged on the tokens known now."""
        if self._drafter is None or self.speculation is None:
            return False
        n = len(self._running)
        for request in self._running:
            if (request.may_draft and request.num_output_tokens and not request.num_draft_tokens
                    and request.sampling.max_tokens - request.num_output_tokens - request.num_pending_samples > 1
                    and self.speculation.worth_drafting(request.seq_id, n, n)
                    and self._drafter.propose(request, 1)):
                return True
        return False

    def _verified(self, chunk: ScheduledChunk, accepted: int) -> None:
        """Count a verified chunk and roll the request back to what was accepted:
        the table keeps the blocks positions up to the accepted end need (the
        worker cuts its own the same way)."""
        request, drafted = chunk.request, chunk.num_draft_tokens
        request.num_draft_tokens = 0
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.acceptance_counts[min(accepted, len(self.acceptance_counts) - 1)] += 1
        if self.speculation is not None:
            self.speculation.observe(request.seq_id, drafted, accepted)
        if request.is_finished:
            return
        end = chunk.start_position + chunk.num_new_tokens - drafted + accepted
        request.num_computed_tokens = end
        self.block_manager.truncate(request, cdiv(end, self.config.block_size))
