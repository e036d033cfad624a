#!/usr/bin/env python3
"""What grammar-masked rows cost the other rows of a CPU sampling step.

    .venv/bin/python bench/sampler_processors.py [--rows 48] [--masked 16] [--vocab 49152] [--reps 200]
        [--threads 2]

One step of ``--rows`` sampled rows (float32 logits, ``--vocab`` wide, each
row Zipf-like over a random order of the tokens), the rows cycling through
greedy, plain (temperature 0.8) and top-p (0.7, 0.9), sampled the way the
worker's runner does it: ``inputs`` = ``InputBatch.sampling`` and
``InputBatch.processors`` (host work), then ``sample_step``. Cases, timed in
turns so that the machine's drift falls on all of them (medians of
``--reps``, ms):

    none     no row masked: no processors
    masked   ``--masked`` random rows with a random token bitmask (about half
             the vocabulary allowed), the others as in ``none``
    alone    only the unmasked rows (``--rows`` - ``--masked``), no processors

``masked - none`` is what the masked rows add to the whole step: with
processors whose cost follows their rows, the same whatever ``--rows``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.worker.runner.input_batch import InputBatch, StagedStep, StepChunk  # noqa: E402
from jitney.worker.runner.sampler import sample_step  # noqa: E402

CPU = torch.device("cpu")
MODES = ((0.0, 1.0), (0.8, 1.0), (0.7, 0.9))   # (temperature, top_p): greedy, plain, top-p


def zipf_logits(rows: int, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 logits, each row Zipf-like over a random order of the
    tokens: as peaked as a language model's, so that top-p rows find their
    nucleus among the top candidates (flat random logits send them all to the full sort)."""
    ranks = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(0)).argsort(dim=-1)
    return -1.5 * torch.log1p(ranks.float())


def staged(rows: int, vocab: int) -> tuple[InputBatch, StagedStep]:
    """An InputBatch holding ``rows`` decoding sequences, one step of them staged."""
    batch = InputBatch(max_num_seqs=rows, max_num_tokens=rows, max_blocks_per_seq=4, block_size=16, device=CPU,
                       vocab_size=vocab)
    for i in range(rows):
        temperature, top_p = MODES[i % len(MODES)]
        batch.add(i, temperature, top_p, 0, seed=i)
    return batch, batch.stage([StepChunk(i, 10, [1], True, i) for i in range(rows)])


def step_timer(batch: InputBatch, step: StagedStep, logits: torch.Tensor,
               masks: tuple[np.ndarray, np.ndarray] | None) -> Callable[[], tuple[float, float]]:
    """One sampling step as ModelRunner._sample does it (less the copy back):
    seconds building its inputs (parameters, groups, processors), seconds in ``sample_step``."""
    def run() -> tuple[float, float]:
        started = time.perf_counter()
        _, params, groups = batch.sampling(step)
        processors = batch.processors(step, masks)
        built = time.perf_counter()
        sample_step(logits, params, groups, processors=processors)
        return built - started, time.perf_counter() - built
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--masked", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    logits = zipf_logits(args.rows, args.vocab)
    masked_rows = np.sort(rng.choice(args.rows, args.masked, replace=False)).astype(np.int64)
    words = rng.integers(-2**31, 2**31, size=(args.masked, -(-args.vocab // 32)), dtype=np.int64).astype(np.int32)
    if args.vocab % 32:
        words[:, -1] &= np.int32((1 << (args.vocab % 32)) - 1)
    batch, step = staged(args.rows, args.vocab)
    kept = np.setdiff1d(np.arange(args.rows), masked_rows)
    alone_batch, alone_step = staged(len(kept), args.vocab)
    cases = {
        "none": step_timer(batch, step, logits, None),
        "masked": step_timer(batch, step, logits, (masked_rows, words)),
        "alone": step_timer(alone_batch, alone_step, logits[kept].contiguous(), None),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for rep in range(args.reps + 5):
        for name, run in cases.items():
            elapsed = run()
            if rep >= 5:   # warm-up
                times[name].append(elapsed)
    print(f"rows {args.rows}, masked {args.masked} ({', '.join(map(str, masked_rows.tolist()))}), vocab {args.vocab}, "
          f"threads {torch.get_num_threads()}, reps {args.reps}; medians, ms")
    print("| case | inputs | sample_step | p10 | p90 | total |\n|---|---|---|---|---|---|")
    total = {}
    for name, t in times.items():
        build, sample = (np.array(column) * 1000 for column in zip(*t))
        total[name] = float(np.median(build + sample))
        p10, p90 = np.percentile(sample, [10, 90])
        print(f"| {name} | {np.median(build):.3f} | {np.median(sample):.3f} | {p10:.3f} | {p90:.3f} | "
              f"{total[name]:.3f} |")
    print(f"total: masked - none {total['masked'] - total['none']:.3f} ms, "
          f"none - alone {total['none'] - total['alone']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
