"""The scheduler's fair-share choices (``--fairness tenant``, ``fairness.py``): who
boards next, who is preempted, a seat for a tenant below its share, the step budget
kept for the boarding request's prompt. A mixin of ``Scheduler``: the state it reads is
the scheduler's own (without fairness, the queue's head and the latest arrival)."""

from __future__ import annotations

from collections import Counter

from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.fairness import TenantFairness, TenantReport
from jitney.scheduler.core.request import Request


def queue_key(request: Request) -> tuple[int, float, int]:
    """Boarding order; the largest key among running is preempted first."""
    return (-request.priority, request.arrival_time, request.seq_id)


class FairSteps:
    """Fair share's choices, on the scheduler's state."""

    config: SchedulerConfig
    fairness: TenantFairness | None
    _waiting: list[Request]
    _held: list[Request]
    _running: list[Request]

    def _served_more(self, tenant: str, than: str) -> bool:
        assert self.fairness is not None
        return self.fairness.service(tenant) > self.fairness.service(than)

    def _fair_seat_taker(self) -> Request | None:
        """With every seat taken: the waiting request that boards next, if its tenant holds
        fewer seats than its weighted share of them (seats x weight / the weights of the
        tenants with work) and the most-served running tenant more than its own. That
        tenant's latest request then gives up its seat (preempted; with the prefix cache its
        full blocks stay cached, so it resumes with little to recompute): a light tenant's
        request does not wait for one of a flood's to finish. Tenants at their shares
        take no seats from each other, so two busy tenants do not thrash; one seat a step."""
        fairness = self.fairness
        if fairness is None or self.config.policy != "continuous" or not self._waiting or not self._running:
            return None
        head = self._next_to_board([])
        victim = self._victim()
        if head.num_pending_samples or not self._served_more(victim.tenant, head.tenant):
            return None
        seats = Counter(r.tenant for r in self._running)
        active = set(seats) | {r.tenant for r in self._waiting}
        total = sum(fairness.weight(t) for t in active)

        def share(tenant: str) -> float:
            return self.config.max_num_seqs * fairness.weight(tenant) / total

        if seats[head.tenant] + 1 > share(head.tenant) or seats[victim.tenant] - 1 < share(victim.tenant):
            return None
        return head

    def _fair_reserve(self) -> tuple[str, int] | None:
        """The waiting request that boards next under fair share, as (its tenant, the
        tokens of the step kept for its prompt: all of it, the whole step at most), where
        it will have a seat; None without fairness or anyone waiting. Prompt chunks of
        other tenants served as much or more (a tenant back from idle is lifted to the
        least counter: a tie) leave it that much of the step's budget: boarding comes
        after running requests' chunks, so a flood's long prompts would otherwise take
        each step's whole budget while a light tenant's short one waits."""
        if self.fairness is None or self.config.policy != "continuous" or not self._waiting:
            return None
        if len(self._running) >= self.config.max_num_seqs:
            taker = self._fair_seat_taker()
            if taker is None:
                return None
            head = taker
        else:
            head = self._next_to_board([])
        if head.num_pending_samples:
            return None
        return head.tenant, min(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)

    def _next_to_board(self, skip: list[Request]) -> Request:
        """The waiting request that boards next, past those in ``skip``."""
        queue = [r for r in self._waiting if r not in skip] if skip else self._waiting
        return queue[0 if self.fairness is None else self.fairness.pick(queue)]

    def _victim(self) -> Request:
        """The running request preempted first."""
        if self.fairness is None:
            return max(self._running, key=queue_key)
        fairness = self.fairness
        return max(self._running, key=lambda r: (fairness.victim_key(r), queue_key(r)))

    def tenant_report(self) -> list[TenantReport]:
        """Per tenant service and queue lengths (``--fairness tenant``; else empty)."""
        if self.fairness is None:
            return []
        return self.fairness.report(self._waiting + self._held, self._running)

