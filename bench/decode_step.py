#!/usr/bin/env python3
"""The worker's decode step on the CPU, by batch size: model time and the rest.

    .venv/bin/python bench/decode_step.py [--dtype float32 bfloat16] [--batch 1 8 16 32 64] [--context 100]
        [--invariant on off] [--layer-stack on off] [--rounds 1] [--model PATH] [--emulate-graphs]
        [--prefill 2048]

Drives the worker's ModelRunner directly with engine plans: each of B
sequences is prefilled with ``--context`` tokens, then ``--reps`` decode
steps are timed. Per step: ``execute`` = wall time of ``runner.execute``
(plan checks, diffs, input staging, forward, logits, sampling, results);
``model`` = forward + logits as the worker reports it (``model_seconds``);
``non-model`` = their difference, the worker's own overhead. Medians.
``--invariant on off`` measures the batch-invariant kernels (the CPU
default) and ``--no-batch-invariant``'s oneDNN path side by side.
``--layer-stack on off`` measures the invariant path's layers in one C++
call (``CausalLM.layer_stack``, the default) and op by op, on the same
runner, in turns over ``--rounds`` rounds (median of the rounds' medians).

To see the host work that a fast GPU forward exposes, use a tiny model
(``--model``, e.g. one made by ``tests/support/tiny_models.py``) so the forward
is negligible, and ``--emulate-graphs``: decode steps then take the CUDA
path's decode-graph route (padded to a captured size, all-greedy rows
read the graph's own choice), the "graph" being the padded forward run
eagerly. ``--prefill N`` also times steps of one new sequence's N-token
chunk (the eager path), the row labelled ``prefill N``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from jitney.engine.v1 import engine_pb2 as e  # noqa: E402
from jitney.worker.config import WorkerConfig  # noqa: E402
from jitney.worker.runner.cuda_graphs import DecodeGraphs, capture_sizes, greedy_packed  # noqa: E402
from jitney.worker.runner.model_runner import ModelRunner  # noqa: E402


class EmulatedGraphs(DecodeGraphs):
    """``DecodeGraphs(capture=False)`` for any attention backend: the padded
    forward with the staged rows' real host lengths (the torch backend reads them)."""

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        seq_lens = tuple(b.region("seq_lens", size).tolist())
        meta = b.metadata(size, size, query_start_loc_host=tuple(range(size + 1)), seq_lens_host=seq_lens,
                          num_decodes=size)
        hidden = self.model(b.region("input_ids", size), b.region("positions", size), meta, self.cache)
        logits = self.model.compute_logits(hidden, self.rows[:size])
        return logits, greedy_packed(logits)


def decode_series(runner: ModelRunner, batch: int, context: int, steps: int,
                  first_seq: int = 1) -> list[tuple[float, float]]:
    """(model seconds, execute seconds) of each of ``steps`` decode steps of ``batch`` new
    sequences (ids from ``first_seq``) prefilled with ``context`` tokens first and freed after."""
    blocks = -(-(context + steps + 8) // runner.limits.block_size)
    seqs = list(range(first_seq, first_seq + batch))
    plan = e.StepPlan(step_id=1)
    for i, seq in enumerate(seqs):
        plan.new_sequences.add(seq_id=seq, sampling=e.SamplingConfig(seed=1))
        plan.chunks.add(seq_id=seq, start_position=0, token_ids=[100 + j for j in range(context)],
                        new_block_ids=list(range(i * blocks, (i + 1) * blocks)), sample=True)
    runner.execute(plan)
    out = []
    for k in range(steps):
        step = e.StepPlan(step_id=2 + k)
        for seq in seqs:
            step.chunks.add(seq_id=seq, start_position=context + k, last_token_from_sample=True, sample=True)
        started = time.perf_counter()
        result = runner.execute(step)
        out.append((result.model_seconds, time.perf_counter() - started))
    runner.execute(e.StepPlan(step_id=2 + steps, freed_seq_ids=seqs))
    return out


def measure(runner: ModelRunner, batch: int, context: int, reps: int) -> tuple[float, float]:
    """Median (model seconds, execute seconds) of ``reps`` decode steps of ``batch`` sequences,
    after two warm-up steps."""
    timed = decode_series(runner, batch, context, reps + 2)[2:]
    return statistics.median(m for m, _ in timed), statistics.median(t for _, t in timed)


def measure_prefill(runner: ModelRunner, tokens: int, reps: int) -> tuple[float, float]:
    """Median (model seconds, execute seconds) of a new sequence's one ``tokens``-token chunk
    (each rep a new sequence, freed by the next plan)."""
    blocks = list(range(-(-tokens // runner.limits.block_size)))
    vocab = runner.limits.vocab_size
    prompt = [(7 * j + 3) % vocab for j in range(tokens)]
    model, total = [], []
    for k in range(reps + 2):
        plan = e.StepPlan(step_id=1000 + k, freed_seq_ids=[k] if k else [])
        plan.new_sequences.add(seq_id=k + 1, sampling=e.SamplingConfig(seed=1))
        plan.chunks.add(seq_id=k + 1, start_position=0, token_ids=prompt, new_block_ids=blocks, sample=True)
        started = time.perf_counter()
        result = runner.execute(plan)
        if k >= 2:   # warm-up
            total.append(time.perf_counter() - started)
            model.append(result.model_seconds)
    runner.execute(e.StepPlan(step_id=2000, freed_seq_ids=[reps + 2]))
    return statistics.median(model), statistics.median(total)


def make_runner(dtype: Any, *, model: str | None = None, invariant: bool = True, prefill: int = 0,
                max_seqs: int = 256, **config: Any) -> ModelRunner:
    """The runner these measurements drive; ``config``: further WorkerConfig fields (e.g. quantization)."""
    return ModelRunner(WorkerConfig(model=model, dtype=dtype, num_blocks=4096,
                                    max_num_batched_tokens=max(16384, prefill), max_num_seqs=max_seqs,
                                    batch_invariant=invariant, **config))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--invariant", nargs="+", choices=["on", "off"], default=["on"],
                        help="batch-invariant kernels (on, the CPU default) and/or --no-batch-invariant (off)")
    parser.add_argument("--quantization", nargs="+", choices=["none", "int8", "int4"], default=["none"],
                        help="weights in the dtype (none) and/or int8 / int4 (the dtype column says which)")
    parser.add_argument("--layer-stack", nargs="+", choices=["on", "off"], default=["on"],
                        help="the CPU's invariant layers in one C++ call (on, the default) and/or op by op (off)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every --layer-stack setting, in turns")
    parser.add_argument("--model", default=None, help="model folder (default: the worker's default model)")
    parser.add_argument("--emulate-graphs", action="store_true",
                        help="decode steps take the CUDA graph path, emulated by an eager padded forward")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="also time a new sequence's one N-token chunk")
    args = parser.parse_args()
    print("| dtype | invariant | layer stack | batch | model ms | execute ms | non-model ms |\n"
          "|---|---|---|---|---|---|---|")
    for dtype, quantization in ((d, q) for d in args.dtype for q in args.quantization):
        for invariant in args.invariant:
            max_seqs = 256
            runner = make_runner(dtype, model=args.model, invariant=invariant == "on", prefill=args.prefill,
                                 max_seqs=max_seqs, quantization=quantization)
            if args.emulate_graphs:
                runner.graphs = EmulatedGraphs(runner.model, runner.cache, runner.batch, capture_sizes(max_seqs),
                                               capture=False)
            rows: list[tuple[str, Callable[[], tuple[float, float]]]] = [
                (str(b), functools.partial(measure, runner, b, args.context, args.reps)) for b in args.batch]
            if args.prefill:
                rows.append((f"prefill {args.prefill}", functools.partial(measure_prefill, runner, args.prefill,
                                                                          args.reps)))
            for label, run in rows:
                got: dict[str, list[tuple[float, float]]] = {setting: [] for setting in args.layer_stack}
                for _ in range(args.rounds):
                    for setting in args.layer_stack:
                        runner.model.use_layer_stack = setting == "on"
                        got[setting].append(run())
                for setting, results in got.items():
                    model_s = statistics.median(m for m, _ in results)
                    total_s = statistics.median(t for _, t in results)
                    stacked = "on" if setting == "on" and runner.model.layer_stack(runner.cache) is not None else "off"
                    label_dtype = dtype if quantization == "none" else f"{dtype}, {quantization} weights"
                    print(f"| {label_dtype} | {invariant} | {stacked} | {label} | {model_s * 1000:.1f} | "
                          f"{total_s * 1000:.1f} | {(total_s - model_s) * 1000:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
