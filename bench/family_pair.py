"""Two family cases of ``bench/families.py`` in one process, timed in alternation.

    .venv/bin/python bench/family_pair.py [--cases llama-1b-gemma-dims,gemma3-1b] [--rounds 5]
        [--models DIR]

Each case's random bf16 checkpoint (``families.make_model``, made once under
``--models``) is loaded by a ``ModelRunner`` (the CPU's batch-invariant kernels,
as `jitney serve` runs them); 16 sequences of 30 prompt tokens are prefilled.
Then each round times, for each case in turn, the median of 3 decode steps of
all 16 sequences and of 3 of one sequence alone. A shared machine's load falls on
both cases alike (round by round, ABAB), which two servers run one after the
other cannot give. Printed: each case's median step times and, for a pair, the
second's over the first's per round (median and range).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.families import make_model  # noqa: E402

SEQS = 16


def once(f: Callable[[], object]) -> float:
    started = time.perf_counter()
    f()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="llama-1b-gemma-dims,gemma3-1b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path("/tmp/jitney-family-pair"))
    ns = parser.parse_args()
    from jitney.worker.config import WorkerConfig
    from jitney.worker.runner.model_runner import ModelRunner
    from tests.support.runner_driver import BLOCK, NUM_BLOCKS, Driver

    cases = ns.cases.split(",")
    blocks = NUM_BLOCKS * 8
    drivers = {}
    for case in cases:
        path = ns.models / case
        if not (path / "config.json").exists():
            make_model(case, path)
        runner = ModelRunner(WorkerConfig(model=str(path), dtype="bfloat16", block_size=BLOCK, num_blocks=blocks,
                                          max_num_batched_tokens=512, max_num_seqs=32, use_weights_cache=False))
        driver = Driver(runner)
        driver.free = list(range(blocks - 1, -1, -1))
        for i in range(SEQS):
            driver.add(i + 1, list(range(10 + i, 40 + i)))
        driver.step({i + 1: 30 for i in range(SEQS)})
        drivers[case] = driver
    times: dict[str, dict[str, list[float]]] = {c: {"decode16": [], "decode1": []} for c in cases}
    for _ in range(ns.rounds):
        for case in cases:
            d = drivers[case]
            times[case]["decode16"].append(statistics.median(
                once(lambda: d.step({i + 1: 1 for i in range(SEQS)})) for _ in range(3)))
            times[case]["decode1"].append(statistics.median(once(lambda: d.step({1: 1})) for _ in range(3)))
    for case in cases:
        print(case, {k: f"{statistics.median(v) * 1e3:.1f} ms" for k, v in times[case].items()})
    if len(cases) == 2:
        a, b = cases
        for kind in times[a]:
            ratios = [y / x for x, y in zip(times[a][kind], times[b][kind])]
            print(f"{b} / {a} {kind}: median {statistics.median(ratios):.3f}, "
                  f"range {min(ratios):.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
