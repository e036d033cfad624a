"""What the scheduler plans for one step (``Scheduler.schedule``'s output,
before ``plan.py`` encodes it for the worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jitney.scheduler.core.lora import LoraLoadOrder
from jitney.scheduler.core.request import Request


@dataclass
class ScheduledChunk:
    """One request's share of a step: positions [start, start + n)."""

    request: Request
    start_position: int        # num_computed_tokens before this step
    num_new_tokens: int
    token_ids: list[int]       # all_token_ids[start:start + n]
    new_block_ids: list[int]   # appended to the block table this step
    sample: bool               # the chunk reaches num_tokens: sample one
    # Its last token is still being sampled by the step before (not in
    # token_ids): the worker fills it in.
    last_token_from_sample: bool = False
    # Speculative decoding: the last this many of token_ids are drafts to
    # verify (the chunk yields 1 + those accepted).
    num_draft_tokens: int = 0
    # Draft model: the worker proposes this many tokens after the step (speculative.ModelDrafter).
    num_proposals: int = 0


@dataclass
class SchedulerOutput:
    """The plan of one step, before it is encoded for the worker."""

    step_id: int                                   # 1, 2, 3, ... per schedule()
    scheduled: list[ScheduledChunk] = field(default_factory=list)   # batch order
    new_seqs: list[Request] = field(default_factory=list)     # worker has no state
    freed_seq_ids: list[int] = field(default_factory=list)    # worker forgets first
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # The first plan after a failed step: the worker forgets every sequence first.
    reset: bool = False
    # --max-step-ms: the step-cost model's model seconds for this step, when planned.
    predicted_seconds: float | None = None
    # LoRA: adapters loaded into slots by this plan, after its frees and
    # before its new sequences (lora.py).
    lora_loads: list[LoraLoadOrder] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the worker: no chunk to run, no sequence to free, no reset."""
        return not self.scheduled and not self.freed_seq_ids and not self.reset
