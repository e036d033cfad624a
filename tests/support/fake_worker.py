"""A fake worker that consumes StepPlans exactly as a real one would.

Every plan first goes through the real worker's checks
(``jitney.worker.runner.plan_checks.validate_plan``, against the same ``SequenceState``s and
``PlanLimits`` the real ``ModelRunner`` keeps) and its diffs are applied with
the real ``apply_plan_diffs``; a plan the real worker would refuse raises the
real ``PlanError``. So every test that drives the scheduler through this fake
also proves that the real worker accepts every plan the scheduler makes.
(``jitney.worker.runner.plan_checks`` imports no torch, and neither may this module:
``test_scheduler.py`` checks it in a fresh interpreter.)

On top of that it keeps a physical "KV cache" (one token id per slot),
writes every computed position through the sequence's block table and
samples by reading the whole history back through it. That catches plans
the real checks accept but the real worker would execute wrongly: a wrong
table, a write to a block another live sequence also holds (prefix sharing
is read-only), a position computed out of order or twice all either raise
``PlanError`` (with "fake worker" in the message) or change the output
tokens. A sequence's first chunk may start past 0 (a prefix-cache hit): it
then reads positions other sequences wrote, so a wrong hit changes the
output tokens.

    token sampled after position p = (sum(tokens[0..p]) * 31 + p + 1) % VOCAB
                                     (+ lora_shift(adapter folder), under an adapter)

LoRA (``max_loras`` slots): the contract of ``StepPlan.lora_loads`` and
``NewSequence.lora_slot`` is checked as a worker would rely on it: a load
goes into a slot 1..max_loras that no live sequence uses (never reloaded
while held), a new sequence's slot holds an adapter, and every cached
position remembers the adapter it was computed under: a sequence that reads
K/V of another adapter (a prefix-cache hit across adapters) raises.

With a ``window`` W (a model whose every layer is windowed) the fake model
reads only the window, ``tokens[p - W + 1..p]``, through the table, and a
sequence's table entries before its next chunk's window are dead: it holds
them no longer (the scheduler has released them and may hand them to
another sequence, or point them at the null block), so a block released
too early is caught as a write to a block another sequence holds, or as
different output tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.plan import to_step_plan
from jitney.scheduler.core.request import Request, SamplingOptions
from jitney.scheduler.core.scheduler import Scheduler, SchedulerOutput

from jitney.worker.runner.plan_checks import (ChunkRow, PlanError, PlanLimits, SequenceState, accept_drafts, apply_plan_diffs,
                                chunk_rows, chunk_tokens, validate_plan)

__all__ = ["VOCAB", "FakeWorker", "lora_shift", "lora_reference_output", "PlanError", "expected_token", "reference_output", "make_request",
           "check_step_limits", "wire_plan", "drive_step", "run_until_idle", "run_pipelined"]

VOCAB = 1000


def expected_token(history: list[int], window: int = 0) -> int:
    """The token the fake model samples after ``history`` (its last ``window`` tokens, if set)."""
    return (sum(history[-window:] if window else history) * 31 + len(history)) % VOCAB


def reference_output(prompt: list[int], num_tokens: int, window: int = 0) -> list[int]:
    """What an uncontended run generates (no EOS, no stops)."""
    history = list(prompt)
    for _ in range(num_tokens):
        history.append(expected_token(history, window))
    return history[len(prompt):]


def lora_shift(path: str) -> int:
    """How an adapter (by its folder) moves the fake model's tokens; 0 for the base ("")."""
    return sum(path.encode()) % (VOCAB - 1) + 1 if path else 0


def lora_reference_output(prompt: list[int], num_tokens: int, path: str) -> list[int]:
    """``reference_output`` under the adapter of folder ``path``."""
    history = list(prompt)
    for _ in range(num_tokens):
        history.append((expected_token(history) + lora_shift(path)) % VOCAB)
    return history[len(prompt):]


class FakeWorker:
    """Executes plans against a fake paged cache; see module docstring.

    ``limits`` are what the real worker would check plans against. Built
    from the cache geometry alone, the context length is the whole cache
    and the step budget and seats are unbounded (``drive_step`` and
    ``run_pipelined`` still check those against the scheduler's config);
    ``for_config`` sets all of them as a real worker serving that config.
    """

    def __init__(self, num_blocks: int, block_size: int, *, limits: PlanLimits | None = None,
                 window: int = 0, model: Callable[[list[int]], int] | None = None,
                 max_loras: int = 0) -> None:
        if limits is None:
            limits = PlanLimits(num_blocks=num_blocks, block_size=block_size,
                                context_length=num_blocks * block_size, vocab_size=VOCAB,
                                max_num_batched_tokens=sys.maxsize, max_num_seqs=sys.maxsize)
        assert (limits.num_blocks, limits.block_size) == (num_blocks, block_size)
        self.limits = limits
        self.block_size = block_size
        self.window = window
        self.live_from: dict[int, int] = {}      # seq_id -> first table entry it still holds
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.holders: dict[int, set[int]] = {}   # block id -> seq_ids holding it
        self.seqs: dict[int, SequenceState] = {}  # the real worker's per-sequence state
        self.num_computed: dict[int, int] = {}    # seq_id -> positions written (absent: none yet)
        self.last_step_id = 0
        # The next token after a history (read back through the table); speculative
        # tests pass a model that repeats itself, so that drafts are accepted.
        self.model = model if model is not None else (lambda history: expected_token(history, window))
        self.num_accepted = 0      # drafts accepted, over every verified chunk
        self.max_loras = max_loras
        self.lora_slots: dict[int, str] = {}      # slot -> the adapter folder loaded there
        self.lora_of: dict[int, tuple[int, str]] = {}   # seq_id -> (slot, folder) it runs with
        self.lora_loads: list[tuple[int, str]] = []     # every (slot, name) loaded, in order
        self.written_by: list[list[str]] = [[""] * block_size for _ in range(num_blocks)]

    @classmethod
    def for_config(cls, config: SchedulerConfig, vocab_size: int = VOCAB,
                   model: Callable[[list[int]], int] | None = None) -> FakeWorker:
        """A worker with the limits a real one serving ``config`` has (its
        context length is taken to be the scheduler's ``max_model_len``)."""
        return cls(config.num_blocks, config.block_size, limits=PlanLimits(
            num_blocks=config.num_blocks, block_size=config.block_size,
            context_length=config.max_model_len, vocab_size=vocab_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs), window=config.sliding_window, model=model,
            max_loras=config.max_loras)

    def execute(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Run one plan; return one token per sampling chunk, in order.

        As ``ModelRunner.execute``: the real checks on the whole plan, then
        the real diffs, then the chunks; a reset plan forgets every sequence
        first. Raises ``PlanError``.
        """
        validate_plan(plan, {} if plan.reset else self.seqs, self.limits)   # raises the real PlanError
        _require(plan.step_id > self.last_step_id,
                 f"step {plan.step_id}: step ids must increase (last {self.last_step_id})")
        self.last_step_id = plan.step_id
        if plan.reset:
            for seq_id in list(self.seqs):
                self._release(seq_id)
            self.seqs.clear()
            self.lora_of.clear()
        for seq_id in plan.freed_seq_ids:
            self._release(seq_id)
        self._load_adapters(plan)
        apply_plan_diffs(plan, self.seqs)
        for chunk in plan.chunks:
            self._hold(chunk)
        result = engine_pb2.StepResult(step_id=plan.step_id)
        for chunk, row in zip(plan.chunks, chunk_rows(plan)):
            if row.num_drafts:
                tokens = self._verify_chunk(chunk, row.num_drafts)
            else:
                token = self._run_chunk(chunk)
                tokens = [] if token is None else [token]
            for token in tokens:
                result.seq_ids.append(chunk.seq_id)
                result.token_ids.append(token)
                result.logprobs.append(-float(token) / VOCAB)
            if row.num_drafts:
                self._accept(row, len(tokens) - 1)
        return result

    def _load_adapters(self, plan: engine_pb2.StepPlan) -> None:
        """The plan's loads (after its frees), then its new sequences' slots."""
        for load in plan.lora_loads:
            _require(1 <= load.slot <= self.max_loras,
                     f"lora load into slot {load.slot}, outside 1..{self.max_loras}")
            users = sorted(s for s, (slot, _) in self.lora_of.items() if slot == load.slot)
            _require(not users, f"lora slot {load.slot} reloaded ({load.name}) while seqs {users} use it")
            self.lora_slots[load.slot] = load.path
            self.lora_loads.append((load.slot, load.name))
        for new in plan.new_sequences:
            if new.lora_slot:
                _require(new.lora_slot in self.lora_slots,
                         f"seq {new.seq_id} runs with lora slot {new.lora_slot}, which holds no adapter")
                self.lora_of[new.seq_id] = (new.lora_slot, self.lora_slots[new.lora_slot])

    def _adapter(self, seq_id: int) -> str:
        return self.lora_of.get(seq_id, (0, ""))[1]

    def _next(self, seq_id: int, history: list[int]) -> int:
        """The model's token after ``history`` under the sequence's adapter."""
        return (self.model(history) + lora_shift(self._adapter(seq_id))) % VOCAB

    def _accept(self, row: ChunkRow, accepted: int) -> None:
        """A verified chunk: the real rule (``accept_drafts``) on the state; the
        cut blocks are held no longer, the positions past the accepted ones
        count as unwritten."""
        seq = self.seqs[row.seq_id]
        for block_id in accept_drafts(seq, row, accepted, self.block_size):
            self.holders[block_id].discard(row.seq_id)
            if not self.holders[block_id]:
                del self.holders[block_id]
        self.num_computed[row.seq_id] = seq.num_computed
        self.num_accepted += accepted

    def _release(self, seq_id: int) -> None:
        """Drop a freed sequence's hold on its blocks (before the diffs forget it)."""
        self.num_computed.pop(seq_id, None)
        self._drop_holds(seq_id, len(self.seqs[seq_id].block_table))
        self.live_from.pop(seq_id, None)
        self.lora_of.pop(seq_id, None)

    def _drop_holds(self, seq_id: int, end: int) -> None:
        """The sequence holds its table entries before ``end`` no longer."""
        table = self.seqs[seq_id].block_table
        for block_id in table[self.live_from.get(seq_id, 0):end]:
            self.holders[block_id].remove(seq_id)
            if not self.holders[block_id]:
                del self.holders[block_id]
        self.live_from[seq_id] = max(self.live_from.get(seq_id, 0), end)

    def _window_start(self, position: int) -> int:
        """The first table entry a query at ``position`` reads."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def _hold(self, chunk: engine_pb2.ScheduledChunk) -> None:
        """Record the chunk's new blocks (already appended by the diffs) as
        held, and drop the entries before its window (dead from now on)."""
        sid, table = chunk.seq_id, self.seqs[chunk.seq_id].block_table
        first_new = len(table) - len(chunk.new_block_ids)
        live = max(self._window_start(chunk.start_position), self.live_from.get(sid, 0))
        self._drop_holds(sid, min(live, first_new))    # first: a released block may come back here
        self.live_from[sid] = live
        for index in range(max(first_new, live), len(table)):
            self.holders.setdefault(table[index], set()).add(sid)
        _require(len(set(table[live:])) == len(table) - live,
                 f"seq {sid}: a block twice in its table {table[live:]}")

    def _run_chunk(self, chunk: engine_pb2.ScheduledChunk) -> int | None:
        seq = self.seqs[chunk.seq_id]
        self._compute(chunk)
        if not chunk.sample:
            return None
        seq.last_sampled = self._next(chunk.seq_id, self._read(chunk.seq_id))
        return seq.last_sampled

    def _verify_chunk(self, chunk: engine_pb2.ScheduledChunk, num_drafts: int) -> list[int]:
        """Compute a chunk with drafts; the choices at its last ``num_drafts`` + 1
        positions up to the first that differs from its draft."""
        seq = self.seqs[chunk.seq_id]
        tokens = self._compute(chunk)
        history = self._read(chunk.seq_id, num_drafts)
        drafts = list(tokens[len(tokens) - num_drafts:])
        base = len(history) - num_drafts
        chosen: list[int] = []
        for j in range(num_drafts + 1):
            chosen.append(self._next(chunk.seq_id, history[:base + j]))
            if j == num_drafts or chosen[-1] != drafts[j]:
                break
        seq.last_sampled = chosen[-1]
        return chosen

    def _compute(self, chunk: engine_pb2.ScheduledChunk) -> np.ndarray | list[int]:
        """Write the chunk's tokens through the table; returns them."""
        seq = self.seqs[chunk.seq_id]
        tokens = chunk_tokens(chunk, seq)
        computed = self.num_computed.get(chunk.seq_id)
        if computed is None:     # first chunk: may start after a cached prefix
            _require(chunk.start_position % self.block_size == 0,
                     f"seq {chunk.seq_id} starts mid-block at {chunk.start_position}")
            computed = chunk.start_position
        _require(chunk.start_position == computed,
                 f"seq {chunk.seq_id}: chunk starts at {chunk.start_position}, computed {computed}")
        for i, token in enumerate(tokens):
            self._write(chunk.seq_id, chunk.start_position + i, token)
        computed += len(tokens)
        self.num_computed[chunk.seq_id] = computed
        _require(len(seq.block_table) == -(-computed // self.block_size),
                 f"seq {chunk.seq_id}: table of {len(seq.block_table)} blocks for {computed} positions")
        return tokens

    def _write(self, seq_id: int, position: int, token: int) -> None:
        table = self.seqs[seq_id].block_table
        block_index = position // self.block_size
        _require(block_index < len(table), f"seq {seq_id}: position {position} has no slot")
        block_id = table[block_index]
        _require(self.holders[block_id] == {seq_id},
                 f"seq {seq_id}: position {position} written to block {block_id}, "
                 f"held by seqs {sorted(self.holders[block_id])}")
        self.cache[block_id][position % self.block_size] = token
        self.written_by[block_id][position % self.block_size] = self._adapter(seq_id)

    def _read(self, seq_id: int, num_drafts: int = 0) -> list[int]:
        """The sequence's computed tokens through its table (zeros before the
        window of its first query: with drafts, the chunk's last non-draft token)."""
        table = self.seqs[seq_id].block_table
        computed = self.num_computed[seq_id]
        first = max(0, computed - num_drafts - self.window) if self.window else 0
        history: list[int] = [0] * first     # never read: outside the window
        for position in range(first, computed):
            _require(self.holders.get(table[position // self.block_size]) is not None
                     and seq_id in self.holders[table[position // self.block_size]],
                     f"seq {seq_id}: position {position} read from a block it does not hold")
            slot = self.cache[table[position // self.block_size]][position % self.block_size]
            _require(slot is not None, f"seq {seq_id}: position {position} never written")
            writer = self.written_by[table[position // self.block_size]][position % self.block_size]
            _require(writer == self._adapter(seq_id), f"seq {seq_id}: position {position} read K/V "
                     f"computed under adapter {writer or 'none'!r}, it runs with {self._adapter(seq_id) or 'none'!r}")
            history.append(slot)  # type: ignore[arg-type]
        return history


def _require(condition: bool, message: str) -> None:
    """A check the real worker does not make (it would compute garbage instead)."""
    if not condition:
        raise PlanError(f"fake worker: {message}")


def make_request(seq_id: int, prompt: list[int] | int, max_tokens: int = 4,
                 priority: int = 0, arrival_time: float | None = None,
                 **sampling: object) -> Request:
    """A request; an int prompt means that many tokens 1, 2, 3, ..."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    options = SamplingOptions(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(seq_id=seq_id, prompt_token_ids=tokens, sampling=options,
                   arrival_time=float(seq_id) if arrival_time is None else arrival_time,
                   priority=priority)


def check_step_limits(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """The step respects the token budget and the seats."""
    config = scheduler.config
    assert output.num_batched_tokens == sum(c.num_new_tokens for c in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    for chunk in output.scheduled:
        assert chunk.num_new_tokens == len(chunk.token_ids) + chunk.last_token_from_sample > 0


def wire_plan(output: SchedulerOutput) -> engine_pb2.StepPlan:
    """``to_step_plan(output)`` as the worker receives it: through the
    ``SchedulerMessage`` bytes the real link sends."""
    message = engine_pb2.SchedulerMessage(plan=to_step_plan(output))
    return engine_pb2.SchedulerMessage.FromString(message.SerializeToString()).plan


def drive_step(scheduler: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[Request]]:
    """schedule -> plan -> worker -> update, checking limits and invariants."""
    output = scheduler.schedule()
    check_step_limits(scheduler, output)
    scheduler.check_invariants()
    result = worker.execute(wire_plan(output))
    updated = scheduler.update_from_output(
        output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
    scheduler.check_invariants()
    return output, updated


def run_until_idle(scheduler: Scheduler, worker: FakeWorker,
                   max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Drive steps until the scheduler has no work; return every output."""
    outputs: list[SchedulerOutput] = []
    while scheduler.has_work():
        assert len(outputs) < max_steps, "scheduler did not drain"
        outputs.append(drive_step(scheduler, worker)[0])
    return outputs


def run_pipelined(scheduler: Scheduler, worker: FakeWorker, depth: int = 2,
                  max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Like ``run_until_idle``, but plan up to ``depth`` steps ahead of the
    results, as the engine does (the worker still runs plans in order)."""
    in_flight: list[tuple[SchedulerOutput, engine_pb2.StepResult]] = []
    outputs: list[SchedulerOutput] = []
    while scheduler.has_work() or in_flight:
        assert len(outputs) < max_steps, "scheduler did not drain"
        if len(in_flight) < depth:
            output = scheduler.schedule()
            check_step_limits(scheduler, output)
            if not output.is_empty:
                in_flight.append((output, worker.execute(wire_plan(output))))
                outputs.append(output)
                continue
        assert in_flight, "work left but nothing scheduled and nothing in flight"
        output, result = in_flight.pop(0)
        scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids),
                                     list(result.logprobs))
        scheduler.check_invariants()
    return outputs
