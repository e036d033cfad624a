"""A minimal scheduler that drives a real ModelRunner with engine_pb2 step plans
(``Driver``), the prompts the runner tests give it, and ``scenario``: one run
through chunked prefill beside decodes, a refused plan, a preemption with
recompute and a masked step, which the tensor-parallel and layer-stack tests
compare across ways of running the same model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.runner.plan_checks import PlanError

if TYPE_CHECKING:
    import torch

    from jitney.worker.runner.model_runner import ModelRunner

BLOCK = 4
NUM_BLOCKS = 96

PROMPTS = {1: [5, 17, 42, 99, 3, 250, 7, 8, 11, 60, 61], 2: [300, 2, 19, 77, 140, 141, 142], 3: list(range(30, 53))}


@dataclass
class Seq:
    """The scheduler's view of one sequence, just enough to write plans."""

    tokens: list[int]
    sampling: pb.SamplingConfig
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    known: bool = False


class Driver:
    """A minimal scheduler: hands out blocks, writes plans, appends samples."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(NUM_BLOCKS - 1, -1, -1))  # hand out high ids first
        self.seqs: dict[int, Seq] = {}
        self.step_id = 0

    def add(self, sid: int, prompt: list[int], temperature: float = 0.0, seed: int = 0) -> None:
        sampling = pb.SamplingConfig(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=seed)
        self.seqs[sid] = Seq(list(prompt), sampling)

    def preempt(self, sid: int) -> None:
        seq = self.seqs[sid]
        self.free += seq.blocks
        seq.blocks, seq.computed, seq.known = [], 0, False

    def masked(self, sid: int) -> bool:
        """Whether ``sid``'s sample in the next plan takes a grammar mask (none here)."""
        return False

    def plan(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> pb.StepPlan:
        """The next step's plan: ``budget[sid]`` more tokens of each sequence, blocks as they fill."""
        plan = pb.StepPlan(step_id=self.step_id, freed_seq_ids=list(freed))
        self.step_id += 1
        for sid, n in budget.items():
            seq = self.seqs[sid]
            if not seq.known:
                plan.new_sequences.add(seq_id=sid, sampling=seq.sampling)
                seq.known = True
            n = min(n, len(seq.tokens) - seq.computed)
            need = math.ceil((seq.computed + n) / BLOCK) - len(seq.blocks)
            new_blocks = [self.free.pop() for _ in range(need)]
            seq.blocks += new_blocks
            sample = seq.computed + n == len(seq.tokens)
            plan.chunks.add(
                seq_id=sid, start_position=seq.computed, token_ids=seq.tokens[seq.computed : seq.computed + n],
                new_block_ids=new_blocks, sample=sample, masked=sample and self.masked(sid),
            )
            seq.computed += n
        return plan

    def step(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> dict[int, int]:
        result = self.runner.execute(self.plan(budget, freed))
        out = dict(zip(result.seq_ids, result.token_ids))
        for sid, token in out.items():
            self.seqs[sid].tokens.append(token)
        return out

    def generate(self, sids: list[int], steps: int, chunk: int = 64) -> None:
        for _ in range(steps):
            self.step({sid: chunk for sid in sids})


def outputs(driver: Driver, sid: int) -> list[int]:
    """What ``sid`` generated after its prompt (one of ``PROMPTS``)."""
    return driver.seqs[sid].tokens[len(PROMPTS[sid]) :]


def scenario(runner: ModelRunner) -> dict[str, Any]:
    """Chunked prefill beside decodes, a refused plan, a preemption with recompute,
    a masked step, greedy and seeded random rows: every sampled token and every
    sampled row's logits."""
    logits: list[list[float]] = []
    sample = runner._sample

    def capture(step: Any, rows: torch.Tensor, *masks: Any) -> Any:
        logits.extend(rows.tolist())
        return sample(step, rows, *masks)

    runner._sample = capture  # type: ignore[method-assign, assignment]
    driver = Driver(runner)
    driver.add(1, PROMPTS[1])
    driver.add(2, PROMPTS[2], temperature=0.8, seed=5)
    driver.add(3, PROMPTS[3])
    driver.generate([1, 2], steps=3)
    for _ in range(5):                                  # seq 3's 23 prompt tokens in chunks of 5, beside decodes
        driver.step({1: 1, 2: 1, 3: 5})
    refused = False
    try:                                                # an unknown sequence: refused on every rank, nothing changed
        runner.execute(pb.StepPlan(step_id=999, chunks=[pb.ScheduledChunk(seq_id=77, start_position=0,
                                                                          token_ids=[1], sample=True)]))
    except PlanError:
        refused = True
    driver.preempt(1)                                   # freed and recomputed in two chunks
    driver.step({1: 9, 2: 1, 3: 1}, freed=(1,))
    driver.generate([1, 2, 3], steps=4)
    _masked_step(runner, driver)
    driver.generate([1, 2, 3], steps=2)
    return {"tokens": {sid: seq.tokens for sid, seq in driver.seqs.items()}, "logits": logits, "refused": refused}


def _masked_step(runner: ModelRunner, driver: Driver) -> None:
    """One step in which seq 3 may only draw ids < 100 (a grammar's mask): the
    masks reach rank 0 alone, the other ranks run the plan without them."""
    words = np.zeros(-(-runner.limits.vocab_size // 32), dtype="<i4")
    words[:3], words[3] = -1, 0xF
    execute = runner.execute

    def masked(plan: pb.StepPlan, wait_for_masks: Any = None) -> pb.StepResult:
        for chunk in plan.chunks:
            chunk.masked = chunk.seq_id == 3
        return execute(plan, lambda step_id: pb.StepMasks(step_id=step_id, seq_ids=[3], bitmask=words.tobytes()))

    runner.execute = masked  # type: ignore[method-assign]
    try:
        out = driver.step({1: 1, 2: 1, 3: 1})
    finally:
        runner.execute = execute  # type: ignore[method-assign]
    assert out[3] < 100


class LoraDriver(Driver):
    """The driver, with each new sequence's LoRA slot (absent: the base model) and the
    first plan's adapter loads, (slot, name, folder)."""

    def __init__(self, runner: ModelRunner, slots: dict[int, int], loads: list[tuple[int, str, Any]]) -> None:
        super().__init__(runner)
        self.slots, self.loads = slots, list(loads)

    def plan(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> pb.StepPlan:
        plan = super().plan(budget, freed)
        for new in plan.new_sequences:
            new.lora_slot = self.slots.get(new.seq_id, 0)
        for slot, name, path in self.loads:
            plan.lora_loads.add(slot=slot, name=name, path=str(path))
        self.loads = []
        return plan
