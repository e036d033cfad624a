"""The step trace (`jitney serve --trace FILE`): one JSON line per step.

Fields of a line:

    step            step id
    t               seconds since the trace started, when the plan was sent
    dur             seconds until its result was back (the step as the scheduler sees it)
    worker_s        worker time from plan received to result sent
    model_s         of which the model itself (forward + logits)
    predicted_s     the step-cost model's model_s for the step (``step_cost.py``): with
                    --max-step-ms as the step was planned (what sized its chunks), else
                    from the steps measured before this one's result; null before any
    seats           seq ids in the batch, in plan order
    prefill_tokens  tokens of chunks with more than one token, or not at the end (prompt work)
    decode_tokens   tokens of one-token chunks that sample, and of chunks verifying
                    drafts (generation work)
    draft_tokens    of which drafts verified (speculative decoding)
    accepted_tokens drafts the step accepted
    samples         chunks that sample a token (rows the head computes)
    context_tokens  keys the step's attention reads at the least: each chunk's
                    sequence up to the chunk's end (start + new tokens), summed
    attended_keys   query-key pairs of the step's causal attention: each new
                    token at position p attends p + 1 keys, summed
    waiting         requests waiting after the step was planned
    running         requests running after the step was planned
    kv_blocks_used  KV blocks held by running requests

`jitney plot` draws the seat chart from these files; the non-model cost of a
step is ``dur - model_s``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

from jitney.scheduler.core.scheduler import Scheduler, SchedulerOutput
from jitney.scheduler.core.step_cost import chunk_keys


class StepTracer:
    """Appends one line per step to a JSONL file."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "w", buffering=1 << 16)
        self._t0: float | None = None     # the first step's start

    def now(self) -> float:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        return time.perf_counter() - self._t0

    def record(self, output: SchedulerOutput, started: float, worker_s: float, model_s: float,
               scheduler: Scheduler, accepted_tokens: int = 0) -> None:
        decode = sum(c.num_new_tokens for c in output.scheduled
                     if c.sample and (c.num_new_tokens == 1 or c.num_draft_tokens))
        chunks = [(c.start_position, c.num_new_tokens) for c in output.scheduled]
        predicted = output.predicted_seconds
        if predicted is None and isinstance(scheduler, Scheduler) and scheduler.step_cost.num_observed:
            predicted = scheduler.predict_step(output)   # off: predicted here, not on every plan
        line: dict[str, Any] = {
            "step": output.step_id,
            "t": round(started, 6),
            "dur": round(self.now() - started, 6),
            "worker_s": round(worker_s, 6),
            "model_s": round(model_s, 6),
            "predicted_s": None if predicted is None else round(predicted, 6),
            "seats": [c.request.seq_id for c in output.scheduled],
            "prefill_tokens": output.num_batched_tokens - decode,
            "decode_tokens": decode,
            "draft_tokens": sum(c.num_draft_tokens for c in output.scheduled),
            "accepted_tokens": accepted_tokens,
            "samples": sum(1 for c in output.scheduled if c.sample),
            "context_tokens": sum(start + n for start, n in chunks),
            "attended_keys": sum(chunk_keys(start, n) for start, n in chunks),
            "waiting": scheduler.num_waiting,
            "running": scheduler.num_running,
            "kv_blocks_used": scheduler.block_manager.num_used_blocks,
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
