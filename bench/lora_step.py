"""Decode-step time of a SmolLM2-shaped Llama (random weights: 30 layers, hidden 576,
intermediate 1536, 9/3 heads; a 320-token vocabulary) in bf16 on the CPU, N sequences,
three ways: LoRA off, 4 rank-16 adapters loaded but every row a base row, and the rows
spread over the 4 adapters (issue 41's offline-64 mix, one step at a time). Each way in
its own runner, three times, interleaved (the best of each reported); a run's time is the
median of 10 decode steps after 2 warm-up steps. A rough figure on a shared machine (with
other processes on the cores, 2 threads gave 0.3-2 s steps: measure with 1 there).

    python bench/lora_step.py [--rows 64] [--threads 1] [--folder /tmp/jitney-lora-step]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import runner_driver  # noqa: E402
from tests.support.tiny_lora import make_peft_adapter  # noqa: E402
from tests.support.tiny_models import make_tiny_llama  # noqa: E402

BLOCKS, ADAPTERS, PROMPT = 2048, 4, 8


class _Driver(runner_driver.LoraDriver):
    """The LoRA test driver with more blocks."""

    def __init__(self, runner: ModelRunner, slots: dict[int, int], loads: list[tuple[int, str, Path]]) -> None:
        super().__init__(runner, slots, loads)
        self.free = list(range(BLOCKS - 1, -1, -1))


def _step_ms(model: Path, adapters: list[Path], rows: int, lora: bool, mix: bool) -> float:
    config = WorkerConfig(model=str(model), dtype="bfloat16", block_size=runner_driver.BLOCK, num_blocks=BLOCKS,
                          max_num_batched_tokens=rows * PROMPT, max_num_seqs=rows,
                          max_loras=ADAPTERS if lora else 0, max_lora_rank=16)
    loads = [(i + 1, f"a{i}", path) for i, path in enumerate(adapters)] if lora else []
    driver = _Driver(ModelRunner(config), {sid: sid % ADAPTERS + 1 for sid in range(rows)} if mix else {}, loads)
    for sid in range(rows):
        driver.add(sid, [(sid * 7 + j) % 300 + 1 for j in range(PROMPT)])
    driver.step({sid: PROMPT for sid in range(rows)})
    times = []
    for _ in range(12):
        start = time.perf_counter()
        driver.step({sid: 1 for sid in range(rows)})
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/jitney-lora-step"))
    args: Any = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.folder / "model"
    if not (model / "config.json").exists():
        make_tiny_llama(model, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    adapters = [args.folder / f"adapter{i}" for i in range(ADAPTERS)]
    for i, path in enumerate(adapters):
        if not (path / "adapter_config.json").exists():
            make_peft_adapter(model, path, rank=16, alpha=32, seed=i, scale=0.02)
    ways = (("LoRA off", False, False), ("loaded, base rows", True, False), ("4-adapter mix", True, True))
    results: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    for _ in range(3):
        for name, lora, mix in ways:
            results[name].append(_step_ms(model, adapters, args.rows, lora, mix))
    off = min(results["LoRA off"])
    for name, times in results.items():
        best = min(times)
        print(f"{args.rows} rows, {args.threads} thread(s), {name:18s}: {best:7.2f} ms/step "
              f"(runs {', '.join(f'{t:.1f}' for t in times)}), throughput {off / best:.2f}x LoRA off")


if __name__ == "__main__":
    main()
