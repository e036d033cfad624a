#!/usr/bin/env python3
"""What grammar masks cost a greedy CPU sampling step: the C++ in-place mask
(``sampler.mask_logits_``) against torch's bit operations (``mask_logits``).

    .venv/bin/python bench/mask_kernel.py [--rows 32] [--vocab 49152] [--reps 60]

``--rows`` greedy rows (``bench/sampler_processors.py``'s Zipf logits and
staging), every row masked with a tool call's kind of mask: odd rows allow one
token (a forced stretch: `{"name": ...`), even rows allow every token but 40
random words' worth (a JSON string's contents). Cases in turns, medians of
``sample_step`` (ms, after 10 warm-up rounds): none (no mask), new (the C++
pass), old (torch's bit operations).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import sampler_processors as sp  # noqa: E402

import jitney.worker.runner.sampler as sampler  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(2)
    sp.MODES = ((0.0, 1.0),)      # type: ignore[assignment]  # every row greedy
    rows, vocab = args.rows, args.vocab
    logits = sp.zipf_logits(rows, vocab)
    batch, step = sp.staged(rows, vocab)
    width = -(-vocab // 32)
    rng = np.random.default_rng(0)
    words = np.full((rows, width), -1, dtype=np.int32)
    for r in range(rows):
        if r % 2:
            words[r] = 0
            t = int(rng.integers(vocab))
            words[r, t // 32] = np.uint32(1 << (t % 32)).view(np.int32)
        else:
            for k in rng.integers(0, width, 40):
                words[r, k] = np.int32(rng.integers(-2**31, 2**31))
    masks = (np.arange(rows, dtype=np.int64), words)

    def run(m: tuple[np.ndarray, np.ndarray] | None) -> float:
        _, params, groups = batch.sampling(step)
        processors = batch.processors(step, m)
        t = time.perf_counter()
        sampler.sample_step(logits, params, groups, processors=processors)
        return time.perf_counter() - t

    new = sampler.mask_logits_
    times: dict[str, list[float]] = {"none": [], "new": [], "old": []}
    for _ in range(args.reps + 10):
        times["none"].append(run(None))
        sampler.mask_logits_ = new
        times["new"].append(run(masks))
        sampler.mask_logits_ = lambda logits, words: sampler.mask_logits(logits, words)
        times["old"].append(run(masks))
    sampler.mask_logits_ = new
    print(f"rows {rows}, vocab {vocab}, reps {args.reps}: sample_step medians, ms")
    for name, samples in times.items():
        print(f"{name:5s} {1e3 * float(np.median(samples[10:])):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
