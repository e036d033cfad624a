"""A fixed run of mixed steps through a ModelRunner, to compare ways of running
one model (tests/worker/test_triton_worker.py: the Triton backend against the
torch one; tests/worker/test_cuda.py: CUDA graphs against eager and the CPU).

Sequences 1 and 2 prefill (2 in two chunks), 3 joins mid-way, then all decode;
greedy, seeded random and top-p/top-k rows (``SAMPLING``). Importing this
module imports no Triton kernel (the Triton tests choose interpreted or
compiled first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jitney.engine.v1 import engine_pb2 as pb

if TYPE_CHECKING:
    from jitney.worker.runner.model_runner import ModelRunner

PROMPTS = {1: [5, 17, 42, 99, 3, 250, 7, 8, 11, 60, 61], 2: [300, 2, 19, 77, 140], 3: list(range(30, 53))}
SAMPLING = {1: pb.SamplingConfig(), 2: pb.SamplingConfig(temperature=0.8, seed=3),
            3: pb.SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, seed=4)}


def generate(runner: ModelRunner, steps: int = 6,
             sampling: dict[int, pb.SamplingConfig] = SAMPLING) -> list[tuple[list[int], list[float]]]:
    """Prefill 1 and 2 (2 in two chunks), 3 joins mid-way; decode all. Per step: (ids, logprobs)."""
    tokens = {sid: list(p) for sid, p in PROMPTS.items()}
    computed, blocks, free = dict.fromkeys(PROMPTS, 0), {sid: [] for sid in PROMPTS}, list(range(63, -1, -1))
    out = []
    for step in range(steps):
        plan = pb.StepPlan(step_id=step)
        active = [1, 2] if step < 2 else [1, 2, 3]
        for sid in active:
            if computed[sid] == 0 and (sid != 2 or step == 0):
                plan.new_sequences.add(seq_id=sid, sampling=sampling[sid])
            n = 3 if (sid == 2 and step == 0) else len(tokens[sid]) - computed[sid]
            need = -(-(computed[sid] + n) // 4) - len(blocks[sid])
            new = [free.pop() for _ in range(need)]
            blocks[sid] += new
            plan.chunks.add(seq_id=sid, start_position=computed[sid], new_block_ids=new,
                            token_ids=tokens[sid][computed[sid] : computed[sid] + n],
                            sample=computed[sid] + n == len(tokens[sid]))
            computed[sid] += n
        result = runner.execute(plan)
        for sid, token in zip(result.seq_ids, result.token_ids):
            tokens[sid].append(token)
        out.append((list(result.token_ids), list(result.logprobs)))
    return out
