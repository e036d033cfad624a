"""The ranks of tests/worker/test_tensor_parallel.py: the worker config of one rank
(or of one process alone), and ``rank_main``, what each rank process runs.

A rank process is started as
``python -c "from tests.support.tensor_parallel_ranks import rank_main; rank_main(...)"``
from the repository root."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner
from tests.support.runner_driver import BLOCK, NUM_BLOCKS, scenario


def tp_config(model: str, rank: int = 0, size: int = 1, port: int = 0) -> WorkerConfig:
    return WorkerConfig(model=model, dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS,
                        max_num_batched_tokens=64, max_num_seqs=8, use_weights_cache=False,
                        tp_rank=rank, tp_size=size, dist_init=f"tcp://127.0.0.1:{port}" if size > 1 else None,
                        dist_timeout=120)


def rank_main(rank: int, port: int, models: list[str], out: str) -> None:
    """One rank of a two-rank group (run in its own process): rank 0 drives the
    scenario for each model and writes what it saw; rank 1 follows."""
    from jitney.worker.distributed import parallel
    from jitney.worker.runner.watchdog import Watchdog

    torch.set_num_threads(1)
    threads = native_threads()
    group = parallel.init_group(tp_config(models[0], rank, 2, port))
    assert group is not None
    results = []
    for model in models:
        runner = ModelRunner(tp_config(model, rank, 2, port), group=group)
        if rank == 0:
            results.append(scenario(runner))
            group.shutdown()                # ends this model's follower loop
        else:
            parallel.follow(runner, group, Watchdog(0))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    group.close()
    # gloo's threads are gone once the group is closed, not at interpreter exit
    # (where tearing them down could abort a rank after a clean shutdown); an exiting
    # thread leaves /proc a moment after it was joined, longer on a loaded machine
    deadline = time.monotonic() + 10
    while native_threads() != threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert native_threads() == threads, (rank, threads, native_threads())


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))
