"""A small scheduler that drives ``ModelRunner`` directly, for batch-invariance tests.

It writes the same engine step plans the real scheduler writes, but every
choice is explicit and reproducible: the tests pick when requests arrive,
the token budget of each step and when to preempt whom, then compare every
request's tokens and log-probs with the request run alone
(``run_alone``: one sequence, the whole prompt in one chunk).

Per step (``BatchDriver.step``), within ``budget`` tokens and ``max_seqs``
seats:

1. decodes first: running sequences with one token left to compute (the
   token the worker sampled last step, sent as ``last_token_from_sample``);
2. then running sequences still in prefill (a resumed one recomputes its
   prompt and everything it generated), in running order, each cut to the
   budget left;
3. then waiting requests, first come first served (a preempted request goes
   back to the head of the queue). A new request whose prompt starts with
   whole cached blocks starts its first chunk at the last such block
   boundary and references those block ids (a prefix-cache hit, at most
   ``len(tokens) - 1`` tokens so the last one is computed). A resumed
   request never uses the cache: it recomputes from position 0 in new blocks.

Blocks are reference counted. A full block whose tokens were computed is
indexed by the tokens up to its end; it stays in the index while any
sequence holds it, and after that until its id is handed out again (free
blocks that were never indexed go first, then the least recently released
indexed ones). Freed blocks go to the back of the free list, so a resumed
sequence gets ids it did not have.

A request finishes after ``max_tokens`` samples (EOS is ignored), so the
schedule depends only on lengths, never on the sampled values: the same
arrivals, budget and preemptions give the same plans whatever the kernels
compute. Finished and preempted sequences are freed in the next plan.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class Request:
    """What a user asks for: a prompt (token ids) and its sampling."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def sampling(self) -> pb.SamplingConfig:
        return pb.SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def describe(self) -> str:
        how = "greedy" if self.temperature == 0 else f"T={self.temperature} top_p={self.top_p} seed={self.seed}"
        head = ",".join(map(str, self.prompt[:6])) + (",..." if len(self.prompt) > 6 else "")
        return f"prompt of {len(self.prompt)} [{head}], {how}, max_tokens={self.max_tokens}"


@dataclass(frozen=True)
class Sample:
    """One output token and the step that produced it."""

    token: int
    logprob: float
    step: int            # the driver's step index (0-based)
    step_seqs: int       # chunks in that step
    step_tokens: int     # tokens computed in that step
    chunk_tokens: int    # this sequence's tokens in that step (1: a decode)


@dataclass
class Output:
    """A request's result and how it was served."""

    request: Request
    samples: list[Sample] = field(default_factory=list)
    cached_tokens: int = 0                 # prompt tokens from the prefix cache (first boarding)
    preempted_after: list[int] = field(default_factory=list)  # outputs held at each preemption
    prefill_chunks: int = 0                # chunks that computed more than one token, or a prompt

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.samples]

    @property
    def logprobs(self) -> list[float]:
        return [s.logprob for s in self.samples]


@dataclass(frozen=True)
class StepInfo:
    step: int
    seqs: int
    tokens: int
    decodes: int
    new: int
    freed: int
    cache_hits: int      # sequences boarding on cached blocks in this step


class BlockPool:
    """Reference-counted KV blocks with a prefix index of full computed blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool) -> None:
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.free: deque[int] = deque(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.index: dict[tuple[int, ...], int] = {}
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()   # indexed, unreferenced: reusable, LRU first

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free) + len(self.idle):
            raise RuntimeError(f"out of KV blocks: {n} wanted, {len(self.free) + len(self.idle)} free")
        out = []
        for _ in range(n):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.idle.popitem(last=False)
                del self.index[self.key_of.pop(block)]
            self.refs[block] = 1
            out.append(block)
        return out

    def attach(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.idle.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.key_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached whole-block prefix of ``tokens``
        (at most ``len(tokens) - 1`` tokens)."""
        if not self.prefix_cache:
            return []
        hits: list[int] = []
        for i in range((len(tokens) - 1) // self.block_size):
            block = self.index.get(tuple(tokens[: (i + 1) * self.block_size]))
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, tokens: Sequence[int], blocks: Sequence[int], computed: int) -> None:
        """Index the full blocks of a sequence whose first ``computed`` tokens are in the cache."""
        if not self.prefix_cache:
            return
        for i in range(computed // self.block_size):
            key = tuple(tokens[: (i + 1) * self.block_size])
            if key not in self.index and blocks[i] not in self.key_of:
                self.index[key] = blocks[i]
                self.key_of[blocks[i]] = key

    @property
    def num_used(self) -> int:
        return len(self.refs)


@dataclass
class _Seq:
    rid: int
    request: Request
    output: Output
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    on_worker: bool = False
    worker_sampled: bool = False   # the worker holds this incarnation's last sample
    resumed: bool = False

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed


# Called before each step with the driver; returns the request ids to preempt now.
PreemptPolicy = Callable[["BatchDriver"], Iterable[int]]


class BatchDriver:
    """Continuous batching over a ``ModelRunner``: see the module docstring."""

    def __init__(self, runner: ModelRunner, *, budget: int, max_seqs: int | None = None,
                 prefix_cache: bool = True, num_blocks: int | None = None) -> None:
        limits = runner.limits
        if runner.sequences:
            raise ValueError(f"the runner still holds sequences {sorted(runner.sequences)}")
        if not 1 <= budget <= limits.max_num_batched_tokens:
            raise ValueError(f"budget {budget} outside [1, {limits.max_num_batched_tokens}]")
        self.runner = runner
        self.budget = budget
        self.max_seqs = min(max_seqs or limits.max_num_seqs, limits.max_num_seqs)
        self.block_size = limits.block_size
        self.pool = BlockPool(num_blocks or limits.num_blocks, limits.block_size, prefix_cache)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.outputs: dict[int, Output] = {}
        self.steps: list[StepInfo] = []
        self.step_index = 0
        self._pending_freed: list[int] = []

    # -- requests -------------------------------------------------------------

    def submit(self, rid: int, request: Request) -> None:
        if rid in self.outputs:
            raise ValueError(f"request {rid} submitted twice")
        if not request.prompt or request.max_tokens < 1:
            raise ValueError(f"request {rid}: empty prompt or max_tokens < 1")
        output = Output(request)
        self.outputs[rid] = output
        self.waiting.append(_Seq(rid, request, output, list(request.prompt)))

    def preempt(self, rid: int) -> None:
        """Free ``rid``'s blocks now; it recomputes everything from position 0 when it boards again."""
        seq = next((s for s in self.running if s.rid == rid), None)
        if seq is None:
            raise ValueError(f"request {rid} is not running")
        self.running.remove(seq)
        self._release(seq)
        seq.output.preempted_after.append(len(seq.output.samples))
        seq.computed, seq.resumed = 0, True
        self.waiting.appendleft(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def running_ids(self) -> list[int]:
        return [s.rid for s in self.running]

    # -- one step -------------------------------------------------------------

    def step(self) -> StepInfo:
        plan = pb.StepPlan(step_id=self.step_index + 1, freed_seq_ids=self._pending_freed)
        self._pending_freed = []
        left = self.budget
        scheduled: list[_Seq] = []
        hits = new = 0
        decodes = [s for s in self.running if s.remaining == 1]
        prefills = [s for s in self.running if s.remaining > 1]
        for seq in decodes + prefills:
            if left == 0:
                break
            n = min(seq.remaining, left)
            scheduled.append(seq)
            self._add_chunk(plan, seq, n, [])
            left -= n
        while self.waiting and left > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting.popleft()
            cached = [] if seq.resumed else self.pool.lookup(seq.tokens)
            self.pool.attach(cached)
            seq.blocks = list(cached)
            seq.computed = len(cached) * self.block_size
            if not seq.resumed:
                seq.output.cached_tokens = seq.computed
            hits += bool(cached)
            plan.new_sequences.add(seq_id=seq.rid, sampling=seq.request.sampling())
            seq.on_worker, seq.worker_sampled = True, False
            new += 1
            self.running.append(seq)
            n = min(seq.remaining, left)
            scheduled.append(seq)
            self._add_chunk(plan, seq, n, cached)
            left -= n
        info = StepInfo(step=self.step_index, seqs=len(plan.chunks), tokens=self.budget - left,
                        decodes=sum(1 for c in plan.chunks if c.last_token_from_sample),
                        new=new, freed=len(plan.freed_seq_ids), cache_hits=hits)
        result = self.runner.execute(plan)
        self._record(plan, result, scheduled, info)
        self.steps.append(info)
        self.step_index += 1
        return info

    def _add_chunk(self, plan: pb.StepPlan, seq: _Seq, n: int, table_head: list[int]) -> None:
        """Schedule ``n`` tokens of ``seq`` from ``seq.computed``; ``table_head``:
        cached blocks a new sequence's table starts with."""
        start, end = seq.computed, seq.computed + n
        need = math.ceil(end / self.block_size) - len(seq.blocks)
        fresh = self.pool.allocate(max(0, need))
        seq.blocks += fresh
        placeholder = seq.worker_sampled and n == 1 and end == len(seq.tokens)
        plan.chunks.add(
            seq_id=seq.rid, start_position=start,
            token_ids=[] if placeholder else seq.tokens[start:end],
            last_token_from_sample=placeholder,
            new_block_ids=table_head + fresh, sample=end == len(seq.tokens),
        )
        if n > 1 or start < len(seq.request.prompt):
            seq.output.prefill_chunks += 1
        seq.computed = end

    def _record(self, plan: pb.StepPlan, result: pb.StepResult, scheduled: list[_Seq],
                info: StepInfo) -> None:
        by_id = {seq.rid: seq for seq in scheduled}
        expected = [c.seq_id for c in plan.chunks if c.sample]
        if list(result.seq_ids) != expected:
            raise AssertionError(f"step {info.step}: result lists {list(result.seq_ids)}, plan samples {expected}")
        chunk_len = {c.seq_id: len(c.token_ids) + c.last_token_from_sample for c in plan.chunks}
        for sid, token, logprob in zip(result.seq_ids, result.token_ids, result.logprobs):
            seq = by_id[sid]
            seq.tokens.append(token)
            seq.worker_sampled = True
            seq.output.samples.append(Sample(token, logprob, info.step, info.seqs, info.tokens, chunk_len[sid]))
        for seq in scheduled:
            self.pool.register(seq.tokens, seq.blocks, seq.computed)
            if len(seq.output.samples) >= seq.request.max_tokens:
                self.running.remove(seq)
                self._release(seq)

    def _release(self, seq: _Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        if seq.on_worker:
            self._pending_freed.append(seq.rid)
            seq.on_worker = seq.worker_sampled = False

    def flush(self) -> None:
        """Tell the worker about the last freed sequences (a plan with no chunks)."""
        if self._pending_freed:
            plan = pb.StepPlan(step_id=self.step_index + 1, freed_seq_ids=self._pending_freed)
            self._pending_freed = []
            self.step_index += 1
            self.runner.execute(plan)

    # -- whole runs -----------------------------------------------------------

    def run(self, arrivals: Mapping[int, Sequence[tuple[int, Request]]], *,
            preempt: PreemptPolicy | None = None, max_steps: int = 100_000) -> dict[int, Output]:
        """Submit ``arrivals[step]`` (request id, request) before that step, apply
        ``preempt`` before every step, and step until every request is done."""
        last_arrival = max(arrivals, default=0)
        while self.step_index <= last_arrival or not self.done:
            if self.step_index >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            for rid, request in arrivals.get(self.step_index, ()):
                self.submit(rid, request)
            if preempt is not None:
                for rid in preempt(self):
                    self.preempt(rid)
            if self.done:
                self.step_index += 1        # nothing to run until the next arrival
                continue
            self.step()
        self.flush()
        if self.pool.num_used or self.runner.sequences:
            raise AssertionError(f"leak: {self.pool.num_used} blocks held, worker keeps {sorted(self.runner.sequences)}")
        return self.outputs


def preempt_by_position(at: Mapping[int, Sequence[int]]) -> PreemptPolicy:
    """Before step ``s``, preempt the running requests at positions ``at[s]``
    (taken modulo the number running; nothing when none runs)."""
    def policy(driver: BatchDriver) -> list[int]:
        running = driver.running_ids()
        if not running:
            return []
        return list(dict.fromkeys(running[i % len(running)] for i in at.get(driver.step_index, ())))
    return policy


def run_alone(runner: ModelRunner, request: Request) -> Output:
    """The reference: ``request`` as the only sequence, its whole prompt in one chunk."""
    limit = runner.limits.max_num_batched_tokens
    if len(request.prompt) > limit:
        raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit one step of {limit}")
    driver = BatchDriver(runner, budget=limit, prefix_cache=False)
    return driver.run({0: [(0, request)]})[0]


def first_difference(reference: Output, got: Output) -> str | None:
    """None when tokens and log-probs are bit-identical, else where they first
    differ (and where the token ids first differ, if they do)."""
    pairs = list(zip(reference.samples, got.samples))
    first = next((k for k, (a, b) in enumerate(pairs) if a.token != b.token or a.logprob != b.logprob), None)
    token = next((k for k, (a, b) in enumerate(pairs) if a.token != b.token), None)
    if first is None:
        if len(reference.samples) != len(got.samples):
            return f"lengths differ: alone {len(reference.samples)}, batched {len(got.samples)}"
        return None
    ref, out = pairs[first]
    what = "token differs" if first == token else "logprob differs (same token)"
    then = "" if token is None or token == first else f"; token ids first differ at output {token}"
    return (f"{what} at output {first} (step {out.step}: {out.step_seqs} seqs, {out.step_tokens} tokens, "
            f"its chunk {out.chunk_tokens}): alone {ref.token} ({ref.logprob!r}), batched {out.token} "
            f"({out.logprob!r}){then}")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count (process-wide) set to ``n`` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
