"""A fake worker that consumes StepPlans exactly as a real one would.

It keeps a physical "KV cache" (one token id per slot), rebuilds each
sequence's block table from the plan diffs, writes every computed position
through that table and samples by reading the whole history back through it.
A wrong table, a write to a block another live sequence also holds (prefix
sharing is read-only), a position computed out of order or twice all either
raise ``PlanError`` or change the output tokens. A sequence's first chunk may
start past 0 (a prefix-cache hit): it then reads positions other sequences
wrote, so a wrong hit changes the output tokens.

    token sampled after position p = (sum(tokens[0..p]) * 31 + p + 1) % VOCAB
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client._generated.jitney.engine.v1 import engine_pb2
from scheduler.plan import to_step_plan
from scheduler.request import Request, SamplingOptions
from scheduler.scheduler import Scheduler, SchedulerOutput

VOCAB = 1000


class PlanError(AssertionError):
    """The plan is one a real worker could not execute correctly."""


def expected_token(history: list[int]) -> int:
    """The token the fake model samples after ``history``."""
    return (sum(history) * 31 + len(history)) % VOCAB


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    """What an uncontended run generates (no EOS, no stops)."""
    history = list(prompt)
    for _ in range(num_tokens):
        history.append(expected_token(history))
    return history[len(prompt):]


@dataclass
class _Sequence:
    sampling: engine_pb2.SamplingConfig
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    last_sampled: int | None = None


class FakeWorker:
    """Executes plans against a fake paged cache; see module docstring."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.holders: dict[int, set[int]] = {}   # block id -> seq_ids holding it
        self.seqs: dict[int, _Sequence] = {}
        self.last_step_id = 0

    def execute(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Run one plan; return one token per sampling chunk, in order."""
        _require(plan.step_id > self.last_step_id, "step ids must increase")
        self.last_step_id = plan.step_id
        for seq_id in plan.freed_seq_ids:
            self._free(seq_id)
        for new in plan.new_sequences:
            _require(new.seq_id not in self.seqs, f"seq {new.seq_id} added twice")
            self.seqs[new.seq_id] = _Sequence(sampling=new.sampling)
        result = engine_pb2.StepResult(step_id=plan.step_id)
        seen: set[int] = set()
        for chunk in plan.chunks:
            _require(chunk.seq_id not in seen, f"seq {chunk.seq_id} twice in a step")
            seen.add(chunk.seq_id)
            token = self._run_chunk(chunk)
            if token is not None:
                result.seq_ids.append(chunk.seq_id)
                result.token_ids.append(token)
                result.logprobs.append(-float(token) / VOCAB)
        return result

    def _free(self, seq_id: int) -> None:
        _require(seq_id in self.seqs, f"freeing unknown seq {seq_id}")
        for block_id in self.seqs.pop(seq_id).table:
            self.holders[block_id].remove(seq_id)
            if not self.holders[block_id]:
                del self.holders[block_id]

    def _run_chunk(self, chunk: engine_pb2.ScheduledChunk) -> int | None:
        _require(chunk.seq_id in self.seqs, f"chunk for unknown seq {chunk.seq_id}")
        seq = self.seqs[chunk.seq_id]
        for block_id in chunk.new_block_ids:
            _require(block_id not in seq.table,
                     f"block {block_id} twice in the table of seq {chunk.seq_id}")
            self.holders.setdefault(block_id, set()).add(chunk.seq_id)
            seq.table.append(block_id)
        tokens = list(chunk.token_ids)
        if chunk.last_token_from_sample:
            _require(seq.last_sampled is not None, f"seq {chunk.seq_id}: no sample to fill in")
            tokens.append(seq.last_sampled)  # type: ignore[arg-type]
        _require(len(tokens) > 0, "empty chunk")
        if seq.num_computed == 0:     # first chunk: may start after a cached prefix
            _require(chunk.start_position % self.block_size == 0,
                     f"seq {chunk.seq_id} starts mid-block at {chunk.start_position}")
            seq.num_computed = chunk.start_position
        _require(chunk.start_position == seq.num_computed,
                 f"seq {chunk.seq_id}: chunk starts at {chunk.start_position}, "
                 f"computed {seq.num_computed}")
        for i, token in enumerate(tokens):
            self._write(seq, chunk.start_position + i, token)
        seq.num_computed += len(tokens)
        _require(len(seq.table) == -(-seq.num_computed // self.block_size),
                 f"seq {chunk.seq_id}: table of {len(seq.table)} blocks "
                 f"for {seq.num_computed} positions")
        if not chunk.sample:
            return None
        seq.last_sampled = expected_token(self._read(seq))
        return seq.last_sampled

    def _write(self, seq: _Sequence, position: int, token: int) -> None:
        block_index = position // self.block_size
        _require(block_index < len(seq.table), f"position {position} has no slot")
        block_id = seq.table[block_index]
        _require(len(self.holders[block_id]) == 1,
                 f"position {position} written to block {block_id}, "
                 f"shared by seqs {sorted(self.holders[block_id])}")
        self.cache[block_id][position % self.block_size] = token

    def _read(self, seq: _Sequence) -> list[int]:
        history: list[int] = []
        for position in range(seq.num_computed):
            slot = self.cache[seq.table[position // self.block_size]][position % self.block_size]
            if slot is None:
                raise PlanError(f"position {position} never written")
            history.append(slot)
        return history


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PlanError(message)


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


def drive_step(scheduler: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[Request]]:
    """schedule -> plan -> worker -> update, checking limits and invariants."""
    output = scheduler.schedule()
    check_step_limits(scheduler, output)
    scheduler.check_invariants()
    result = worker.execute(to_step_plan(output))
    updated = scheduler.update_from_output(
        output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
    scheduler.check_invariants()
    return output, updated


def run_until_idle(scheduler: Scheduler, worker: FakeWorker,
                   max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Drive steps until the scheduler has no work; return every output."""
    outputs = []
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
                in_flight.append((output, worker.execute(to_step_plan(output))))
                outputs.append(output)
                continue
        assert in_flight, "work left but nothing scheduled and nothing in flight"
        output, result = in_flight.pop(0)
        scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids),
                                     list(result.logprobs))
        scheduler.check_invariants()
    return outputs
