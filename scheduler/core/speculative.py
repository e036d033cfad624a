"""Speculative decoding, the scheduler's side: drafters and the rule that
decides, each step, how many drafts each decoding sequence may verify.

A drafter proposes the tokens a sequence will likely produce next; the step
then computes the sequence's last token and the drafts as one chunk, the
worker takes the target's own choice at every position (its sampling, as
without speculation) and accepts drafts while they equal those choices. The
output is therefore the same, bit for bit, as without speculation: the
choice at a position is a function of that position's logits (batch- and
chunk-invariant on the CPU) and of its noise, keyed by (seed, position,
token), so accepting a draft equal to the choice changes nothing.

    drafter     where            proposes
    ngram       scheduler        the tokens that followed the latest earlier
                                 occurrence of the longest n-gram (n = 4..1)
                                 ending at the sequence's last token
    suffix      scheduler        the same over n = 8..1, in the sequence and in
                                 the recent finished sequences of its cache_salt
    draft       worker           a small model's greedy tokens (--draft-model),
                                 made after the step before when the plan
                                 asked (``num_proposals``), handed over with
                                 its result (``ModelDrafter``)

The rule (``SpeculationPolicy``): each sequence has a running acceptance
estimate ``alpha`` (the chance a draft is accepted given the ones before it
were); its i-th draft is worth ``alpha ** i`` expected tokens. The step's
cost model ``t(T) = a + b * T`` is fitted to the measured model times of
recent steps (T tokens each). A step of N sampled sequences yields N tokens
in ``t``; k drafts add ``b * k`` seconds (and the pipelining the engine
gives up for a drafted step, ``overhead`` seconds) and ``E`` expected
tokens. Drafts are taken in decreasing worth while one is worth more than
it costs, ``alpha ** i * t / N > b``, and the step drafts at all only if
``E * t / N > b * k + overhead``: the step's tokens per second must rise.
When the step is weight-bound (``b`` small against ``t / N``) drafts are
nearly free and a sequence that is often right drafts the most it may; at
many sequences or a large ``b`` (compute-bound) the step drafts little or
nothing.

A draft model's drafts cost more than verifying: its measured seconds per
drafted token ``c`` (``observe_draft``) is added to ``b`` in both tests, so
a draft model whose drafts are seldom accepted is switched off (the
scheduler then asks it for nothing, and it costs nothing).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from jitney.scheduler.core.request import Request
from jitney.scheduler.core.step_cost import StepCostModel

SpeculativeMethod = Literal["off", "ngram", "suffix", "draft"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)

NGRAM_MAX = 4     # the longest n-gram looked up
NGRAM_MIN = 1     # the shortest


class Drafter(Protocol):
    """Proposes drafts for one sequence at a time (scheduler-side drafters)."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafts to follow the request's prompt + output
        (which only ever grow for one request)."""
        ...

    def forget(self, seq_id: int) -> None:
        """The sequence left: drop what is kept for it."""
        ...


class NgramIndex:
    """One sequence's n-grams (n = NGRAM_MIN..NGRAM_MAX) -> where the token
    after their latest occurrence sits, kept as the sequence grows: adding a
    token costs NGRAM_MAX dictionary writes, a proposal NGRAM_MAX lookups.

    An n-gram enters the index only once the token after it is known, so a
    lookup of the n-gram ending at the last token finds an earlier occurrence.
    """

    def __init__(self, max_n: int = NGRAM_MAX) -> None:
        self.tokens: list[int] = []
        self.max_n = max_n
        self._follows: dict[tuple[int, ...], int] = {}

    def extend(self, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        """Catch up with the sequence ``prompt + output`` (a longer version of the last)."""
        num_prompt = len(prompt)
        for position in range(len(self.tokens), num_prompt + len(output)):
            self.tokens.append(prompt[position] if position < num_prompt else output[position - num_prompt])
            for n in range(NGRAM_MIN, self.max_n + 1):
                if position - n < 0:
                    break
                # The n-gram ending just before ``position`` is followed by it.
                self._follows[tuple(self.tokens[position - n:position])] = position

    def propose(self, max_tokens: int) -> list[int]:
        """The tokens that followed the longest n-gram ending at the last token."""
        return self.match(self.tokens, max_tokens)[1]

    def match(self, suffix: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """The longest n-gram ending ``suffix`` found here (n, 0 if none) and up to
        ``max_tokens`` of what followed its latest occurrence."""
        if max_tokens <= 0:
            return 0, []
        length = len(suffix)
        for n in range(min(self.max_n, length), NGRAM_MIN - 1, -1):
            start = self._follows.get(tuple(suffix[length - n:]))
            if start is not None:
                return n, self.tokens[start:start + max_tokens]
        return 0, []


class NgramDrafter:
    """Prompt lookup: each sequence's own prompt and output, indexed as it grows."""

    def __init__(self) -> None:
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        index = self._indexes.get(request.seq_id)
        if index is None:
            index = self._indexes[request.seq_id] = NgramIndex()
        index.extend(request.prompt_token_ids, request.output_token_ids)
        return index.propose(max_tokens)

    def forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)


SUFFIX_MAX = 8            # the longest suffix matched by ``suffix``
SUFFIX_TOKENS = 8192      # tokens of finished sequences kept per cache_salt
SUFFIX_SALTS = 16         # cache_salts kept (the least recently finished dropped)


class _Recent:
    """One cache_salt's finished sequences, oldest first, at most ``budget``
    tokens in all, indexed together: n-gram (n = 1..SUFFIX_MAX) -> (sequence,
    position after its latest occurrence). A sequence that leaves takes its
    n-grams with it (those no later one took over)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.num_tokens, self._next = budget, 0, 0
        self._sequences: OrderedDict[int, list[int]] = OrderedDict()
        self._follows: dict[tuple[int, ...], tuple[int, int]] = {}

    def add(self, tokens: list[int]) -> None:
        tokens = tokens[-self.budget:]
        key, self._next = self._next, self._next + 1
        self._sequences[key] = tokens
        self.num_tokens += len(tokens)
        for position in range(1, len(tokens)):
            for n in range(1, min(SUFFIX_MAX, position) + 1):
                self._follows[tuple(tokens[position - n:position])] = (key, position)
        while self.num_tokens > self.budget:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        key, tokens = self._sequences.popitem(last=False)
        self.num_tokens -= len(tokens)
        for position in range(1, len(tokens)):
            for n in range(1, min(SUFFIX_MAX, position) + 1):
                gram = tuple(tokens[position - n:position])
                if self._follows.get(gram, (None, 0))[0] == key:
                    del self._follows[gram]

    def match(self, suffix: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """As ``NgramIndex.match``, over these sequences."""
        length = len(suffix)
        for n in range(min(SUFFIX_MAX, length), 0, -1):
            hit = self._follows.get(tuple(suffix[length - n:]))
            if hit is not None:
                key, position = hit
                return n, self._sequences[key][position:position + max_tokens]
        return 0, []

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)


class SuffixDrafter:
    """Suffix matching over the sequence itself and over the recent finished
    sequences of the same ``cache_salt`` (agent and code-editing traffic
    restates earlier answers): the longest match, up to SUFFIX_MAX tokens,
    of the sequence's last tokens; its own text wins a tie. Bounded: the last
    SUFFIX_TOKENS tokens of finished sequences for each of the SUFFIX_SALTS
    salts that finished one most recently; a salt's text is never proposed to
    another salt. A proposal costs 2 x SUFFIX_MAX lookups."""

    def __init__(self, max_tokens: int = SUFFIX_TOKENS, max_salts: int = SUFFIX_SALTS) -> None:
        self.max_tokens, self.max_salts = max_tokens, max_salts
        self._own: dict[int, tuple[str, NgramIndex]] = {}
        self._recent: OrderedDict[str, _Recent] = OrderedDict()

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        own = self._own.get(request.seq_id)
        if own is None:
            own = self._own[request.seq_id] = (request.cache_salt, NgramIndex(SUFFIX_MAX))
        index = own[1]
        index.extend(request.prompt_token_ids, request.output_token_ids)
        best, proposal = index.match(index.tokens, max_tokens)
        recent = self._recent.get(request.cache_salt)
        if recent is not None and max_tokens > 0:
            n, tokens = recent.match(index.tokens, max_tokens)
            if n > best and tokens:
                proposal = tokens
        return proposal

    def forget(self, seq_id: int) -> None:
        """A finished sequence joins its salt's recent ones."""
        own = self._own.pop(seq_id, None)
        if own is None:
            return
        salt, index = own
        recent = self._recent.pop(salt, None) or _Recent(self.max_tokens)
        recent.add(index.tokens)
        self._recent[salt] = recent
        while len(self._recent) > self.max_salts:
            self._recent.popitem(last=False)

    def kept(self, salt: str) -> tuple[int, int]:
        """(finished sequences, their tokens) kept for ``salt``."""
        recent = self._recent.get(salt)
        return (recent.num_sequences, recent.num_tokens) if recent is not None else (0, 0)


class ModelDrafter:
    """The worker's draft model (``--speculative draft``): the scheduler asks for
    proposals in a plan (``ScheduledChunk.num_proposals``) and gets them with that
    step's result (``receive``). A proposal made when the sequence held ``start``
    tokens is used only while it still holds that many: one made before a step
    that was already planned (pipelined) is stale and never drafted."""

    def __init__(self) -> None:
        self._proposals: dict[int, tuple[int, list[int]]] = {}   # seq id -> (start, tokens)

    def receive(self, seq_id: int, start: int, tokens: Sequence[int]) -> None:
        self._proposals[seq_id] = (start, list(tokens))

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        start, tokens = self._proposals.get(request.seq_id, (-1, []))
        return tokens[:max(0, max_tokens)] if start == request.num_tokens else []

    def forget(self, seq_id: int) -> None:
        self._proposals.pop(seq_id, None)

    @property
    def num_kept(self) -> int:
        return len(self._proposals)


def make_drafter(method: SpeculativeMethod) -> Drafter | None:
    """The drafter of ``method`` (None when off)."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramDrafter()
    if method == "suffix":
        return SuffixDrafter()
    if method == "draft":
        return ModelDrafter()
    raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")


@dataclass
class Acceptance:
    """A sequence's running acceptance: decayed counts of drafts accepted and
    of drafts tried (a draft after a rejected one is not tried)."""

    accepted: float = 0.0
    tried: float = 0.0


@dataclass
class DraftCandidate:
    """A decoding sequence the step may extend with drafts."""

    seq_id: int
    proposal: list[int]        # the drafter's tokens, at most the sequence's cap


@dataclass
class SpeculationPolicy:
    """The load-adaptive rule (module docstring). ``prior`` is the acceptance
    a sequence starts from (pulled toward the server's own as drafts are
    verified); ``decay`` weighs a sequence's past steps."""

    num_speculative_tokens: int
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.8
    cost: StepCostModel = field(default_factory=StepCostModel)
    overhead_seconds: float = 0.0    # pipelining given up by a drafted step (the engine measures it)
    draft_seconds_per_token: float = 0.0   # a draft model's time per proposed token (``observe_draft``)
    _per_seq: dict[int, Acceptance] = field(default_factory=dict)
    _total: Acceptance = field(default_factory=Acceptance)

    def alpha(self, seq_id: int) -> float:
        """The sequence's acceptance estimate, in (0, 1)."""
        own = self._per_seq.get(seq_id, Acceptance())
        total = self._total
        prior = (total.accepted + self.prior * self.prior_weight) / (total.tried + self.prior_weight)
        alpha = (own.accepted + prior * self.prior_weight) / (own.tried + self.prior_weight)
        return min(max(alpha, 1e-6), 1 - 1e-6)

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verified chunk: ``accepted`` of its ``drafted`` drafts were right."""
        tried = accepted + (accepted < drafted)
        own = self._per_seq.setdefault(seq_id, Acceptance())
        own.accepted = own.accepted * self.decay + accepted
        own.tried = own.tried * self.decay + tried
        self._total.accepted = self._total.accepted * 0.99 + accepted
        self._total.tried = self._total.tried * 0.99 + tried

    def forget(self, seq_id: int) -> None:
        self._per_seq.pop(seq_id, None)

    def observe_draft(self, seconds: float, num_tokens: int) -> None:
        """A draft model proposed ``num_tokens`` tokens in ``seconds``."""
        if num_tokens > 0 and math.isfinite(seconds) and seconds >= 0:
            per_token = seconds / num_tokens
            seen = self.draft_seconds_per_token
            self.draft_seconds_per_token = per_token if not seen else 0.8 * seen + 0.2 * per_token

    def _draft_cost(self) -> tuple[float, float, float]:
        """(a, b, cost of one draft): b plus a draft model's time per token."""
        a, b = self.cost.fit()
        return a, b, b + self.draft_seconds_per_token

    def worth_drafting(self, seq_id: int, num_tokens: int, num_seqs: int) -> bool:
        """Whether the first draft of ``seq_id`` would pay in a step of about
        ``num_tokens`` tokens over ``num_seqs`` sampled sequences."""
        a, b, per_draft = self._draft_cost()
        t = a + b * num_tokens
        return self.alpha(seq_id) * t / max(1, num_seqs) > per_draft + self.overhead_seconds   # one draft pays

    def draft_lengths(self, candidates: Sequence[DraftCandidate], num_tokens: int, num_seqs: int,
                      budget: int) -> dict[int, int]:
        """How many of its proposal each candidate drafts (absent: none), for
        a step of ``num_tokens`` tokens over ``num_seqs`` sampled sequences,
        with ``budget`` tokens of the step's budget left."""
        a, b, per_draft = self._draft_cost()
        t = a + b * num_tokens
        share = t / max(1, num_seqs)    # seconds one of the step's tokens costs
        offers: list[tuple[float, int, int]] = []   # (worth, seq_id, draft index)
        for c in candidates:
            alpha, worth = self.alpha(c.seq_id), 1.0
            for i in range(min(len(c.proposal), self.num_speculative_tokens)):
                worth *= alpha
                if worth * share <= per_draft:
                    break
                offers.append((worth, c.seq_id, i))
        offers.sort(key=lambda o: (-o[0], o[1], o[2]))
        lengths: dict[int, int] = {}
        expected = 0.0
        for worth, seq_id, i in offers[:max(0, budget)]:
            if lengths.get(seq_id, 0) != i:
                continue    # its earlier drafts did not fit
            lengths[seq_id] = i + 1
            expected += worth
        drafted = sum(lengths.values())
        if not drafted or expected * share <= per_draft * drafted + self.overhead_seconds:
            return {}
        return lengths
