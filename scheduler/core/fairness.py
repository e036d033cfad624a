"""Fair share between tenants (``--fairness tenant``): the Virtual Token Counter.

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024).
A tenant is the name of the caller's API key, else the request's ``user``
(OpenAI doors) or ``tenant`` field (gRPC), else the shared tenant ``""``.
Each tenant has a counter of the service it received:

    service[t] += (PROMPT_TOKEN_WEIGHT * prompt positions computed
                   + OUTPUT_TOKEN_WEIGHT * output positions computed) / weight[t]

charged when the scheduler schedules a chunk. Each position of a request is
charged once (a high-water mark per request): prefix-cache hits and
positions shared from an n > 1 parent cost nothing, recompute after a
preemption (the server's choice, not the tenant's) is not charged again,
and speculative drafts are charged once accepted (with the request's next
chunk), never when rejected.

Why 1 and 2 (VTC's own choice): a prompt position is computed in a batched
prefill at a fraction of a decode position's cost, since a decode position
holds a seat for a whole step and reads the sequence's whole KV cache for
one token; 2 is the ratio VTC uses and a fair middle of what we measure
per token on our CPU and GPU paths (prefill is 2-5x cheaper per token).

    decision                    rule
    boarding                    the waiting request of the least-served tenant
                                among tenants with waiting work; within a
                                tenant, priority then arrival (ties between
                                tenants: queue order)
    preemption victim           a running request of the most-served tenant;
                                within it the lowest priority, latest arrival
    a tenant returns from idle  its counter is lifted to the least counter of
    (no live request)           the active tenants (no banked credit); with no
                                active tenant, to the counter of the last one
                                that was active (``floor``)

Priority and fairness: fairness across tenants first, priority within a
tenant. Priority is the client's own field, so a priority that ranked across
tenants would let a flooding tenant mark its whole load urgent and take the
server back; as a tenant's ordering of its own work it is safe.

Idle tenants' counters are kept (a tenant sending one request at a time is
idle between them and must not shed its debt), at most ``MAX_IDLE_TENANTS``
of them: beyond, the least-served are forgotten first, those at the floor
before any other (a lift would give them that value anyway), so the state
stays bounded however many ``user`` strings clients send.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from jitney.scheduler.core.request import Request

from jitney.common.tenant_weights import MAX_TENANT_WEIGHT, looks_like_weight, parse_weight

__all__ = ["MAX_TENANT_WEIGHT", "looks_like_weight", "parse_weight"]

FairnessMode = Literal["off", "tenant"]
FAIRNESS_MODES: tuple[str, ...] = get_args(FairnessMode)
SHARED_TENANT = ""                # requests with no key, no user, no tenant field
PROMPT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0
MAX_TENANT_CHARS = 256
RESERVED_PREFIX = "jitney:"       # metric labels of the shared tenant and of `other`
MAX_IDLE_TENANTS = 4096

def tenant_problem(tenant: str) -> str | None:
    """Why a client-given tenant (``user``, ``tenant``) is refused, or None."""
    if len(tenant) > MAX_TENANT_CHARS:
        return f"has {len(tenant)} characters, more than the limit {MAX_TENANT_CHARS}"
    if not tenant.isprintable():
        return "must be printable (no control characters)"
    if tenant.startswith(RESERVED_PREFIX):
        return f"must not start with {RESERVED_PREFIX!r} (reserved for the server's own labels)"
    return None


def check_weights(weights: Iterable[tuple[str, float]]) -> None:
    """Raise ValueError on a duplicate tenant or a weight out of range."""
    seen: set[str] = set()
    for tenant, weight in weights:
        if tenant in seen:
            raise ValueError(f"tenant {tenant!r} has two weights")
        seen.add(tenant)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not 0 < weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"tenant {tenant!r}: a weight is a number in (0, {MAX_TENANT_WEIGHT:g}], "
                             f"got {weight!r}")


@dataclass
class TenantState:
    """One tenant as the policy sees it."""

    service: float = 0.0        # the virtual counter (weighted, lifted)
    prompt_tokens: int = 0      # positions charged, by kind (unweighted)
    output_tokens: int = 0


@dataclass(frozen=True)
class TenantReport:
    """A tenant's row in the metrics."""

    tenant: str
    service: float
    prompt_tokens: int
    output_tokens: int
    waiting: int
    running: int


class TenantFairness:
    """The Virtual Token Counter policy; the scheduler calls it at arrival,
    chunk, finish, boarding and preemption. Plain data, no clock."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        check_weights(self._weights.items())
        self._tenants: dict[str, TenantState] = {}
        self._live: Counter[str] = Counter()     # waiting, held or running requests per tenant
        self._charged: dict[int, int] = {}      # seq_id -> positions charged (high-water mark)
        self.floor = 0.0                        # the least active counter when last seen

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def service(self, tenant: str) -> float:
        state = self._tenants.get(tenant)
        return state.service if state is not None else self.floor

    def arrive(self, request: Request) -> None:
        """A request is queued; its tenant, if idle, is lifted (no banked credit)."""
        tenant = request.tenant
        idle = not self._live[tenant]
        if idle:
            lift = self._least_active()
            state = self._tenants.setdefault(tenant, TenantState(service=lift))
            state.service = max(state.service, lift)
        self._live[tenant] += 1
        if idle:
            self._prune()

    def leave(self, request: Request) -> None:
        """A request finished (or was aborted) wherever it was."""
        self._charged.pop(request.seq_id, None)
        tenant = request.tenant
        self._live[tenant] -= 1
        if self._live[tenant] <= 0:
            del self._live[tenant]
            if not self._live:      # the last active tenant: a newcomer starts here
                self.floor = max(self.floor, self.service(tenant))
            else:
                self._least_active()

    def charge(self, request: Request, start: int, num_new: int) -> None:
        """Positions [start, start + num_new) of ``request`` are scheduled."""
        end = start + num_new
        done = self._charged.get(request.seq_id, start)   # a first chunk past a cached prefix pays from there
        if end <= done:
            self._charged.setdefault(request.seq_id, done)
            return
        self._charged[request.seq_id] = end
        p = request.num_prompt_tokens
        prompt = max(0, min(end, p) - min(done, p))
        output = (end - done) - prompt
        state = self._tenants.setdefault(request.tenant, TenantState(service=self.floor))
        state.prompt_tokens += prompt
        state.output_tokens += output
        state.service += (PROMPT_TOKEN_WEIGHT * prompt + OUTPUT_TOKEN_WEIGHT * output) / self.weight(request.tenant)

    def pick(self, waiting: Sequence[Request]) -> int:
        """The index in ``waiting`` (queue order) of the request to board next."""
        return min(range(len(waiting)), key=lambda i: (self.service(waiting[i].tenant), i))

    def victim_key(self, request: Request) -> float:
        """Preemption: the running request with the largest (this, queue key) goes first."""
        return self.service(request.tenant)

    def report(self, waiting: Iterable[Request], running: Iterable[Request]) -> list[TenantReport]:
        """Every known tenant, the most-served first."""
        queued, riding = Counter(r.tenant for r in waiting), Counter(r.tenant for r in running)
        names = set(self._tenants) | set(queued) | set(riding)
        rows = [TenantReport(t, self.service(t), self._tenants.get(t, TenantState()).prompt_tokens,
                             self._tenants.get(t, TenantState()).output_tokens, queued[t], riding[t])
                for t in names]
        return sorted(rows, key=lambda row: (-row.service, row.tenant))

    def _least_active(self) -> float:
        """The least counter of the active tenants (the floor follows it); the floor if none."""
        if self._live:
            self.floor = max(self.floor, min(self.service(t) for t in self._live))
        return self.floor

    def _prune(self) -> None:
        """Beyond MAX_IDLE_TENANTS idle tenants, forget the least-served: those
        at the floor first, which a lift would bring back to it anyway."""
        if len(self._tenants) - len(self._live) <= MAX_IDLE_TENANTS:
            return
        idle = sorted((t for t in self._tenants if t not in self._live), key=lambda t: self._tenants[t].service)
        for tenant in idle[:len(idle) - MAX_IDLE_TENANTS]:
            del self._tenants[tenant]
