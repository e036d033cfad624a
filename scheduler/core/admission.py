"""Admission control: the bounds a new request must fit in to be queued.

Checked when a request is submitted, so an overloaded server answers
RESOURCE_EXHAUSTED at once instead of queueing without end; and the time a
request may take (the call's gRPC deadline, capped by the server's own).
Policy only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


class QueueFullError(RuntimeError):
    """The waiting queue is at one of its bounds; the message says which."""


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on the waiting queue and on a request's lifetime."""

    max_queued_requests: int = 256
    """Most requests waiting (not yet running, or preempted) at once."""

    max_queued_tokens: int = 262_144
    """Most tokens (prompt and output so far) of the waiting requests at once."""

    max_request_seconds: float | None = None
    """Server-side cap on a request's lifetime; None = only the call's deadline."""

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1 or self.max_queued_tokens < 1:
            raise ValueError("max_queued_requests and max_queued_tokens must be >= 1")
        if self.max_request_seconds is not None and not self.max_request_seconds > 0:
            raise ValueError(f"max_request_seconds must be > 0, got {self.max_request_seconds}")

    def check(self, num_waiting: int, waiting_tokens: int, new_tokens: int) -> None:
        """Raise QueueFullError if one more request of ``new_tokens`` does not fit."""
        if num_waiting >= self.max_queued_requests:
            raise QueueFullError(
                f"the server is overloaded: {num_waiting} requests are waiting "
                f"(limit --max-queued-requests {self.max_queued_requests}); retry later")
        # An empty queue takes any request: the bound must not refuse one outright.
        if num_waiting and waiting_tokens + new_tokens > self.max_queued_tokens:
            raise QueueFullError(
                f"the server is overloaded: {waiting_tokens} prompt tokens are waiting and this "
                f"request adds {new_tokens} (limit --max-queued-tokens {self.max_queued_tokens}); "
                "retry later")

    def time_limit(self, time_remaining: float | None) -> float | None:
        """Seconds the request may live: the call's deadline, capped by ours."""
        limits = [t for t in (time_remaining, self.max_request_seconds) if t is not None]
        return min(limits) if limits else None
