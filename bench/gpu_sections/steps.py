"""The decode and prefill sections: one ``ModelRunner`` per shape, its steps timed around ``execute()``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.gpu_sections.measure import decode_batches, make_runner, measure_decode, measure_prefill, runner_blocks
from bench.gpu_sections.plumbing import Run, env_var, free_device_memory, is_cuda, log
from bench.gpu_sections.profiles import host_profile_steps, profile_steps

if TYPE_CHECKING:
    from jitney.worker.runner.model_runner import ModelRunner


def section_steps(shape: str, model: Path, sections: list[str], run: Run) -> None:
    """decode and/or prefill on one ModelRunner (it is freed before returning)."""
    if not run.budget.allows(run.args.steps_reserve_s):
        run.skip(f"{shape} {'/'.join(sections)}", f"{run.budget.left():.0f} s left of the budget")
        return
    batches = decode_batches(run.args) if "decode" in sections else []
    per_seq, total = runner_blocks(run, batches)
    # The Triton cache the servers warmed (CUDA): the runner does not compile the kernels again.
    with env_var("TRITON_CACHE_DIR", run.triton_cache):
        started = time.perf_counter()
        runner = make_runner(model, run, max(batches, default=1), total)
        run.shape(shape).update(runner_init_s=time.perf_counter() - started,
                                runner_warmup_s=getattr(runner, "warmup_seconds", None))
        log(f"== {shape}: ModelRunner ready in {time.perf_counter() - started:.1f} s ({total} KV blocks)")
        try:
            steps_decode(shape, runner, batches, per_seq, run)
            if "prefill" in sections:
                steps_prefill(shape, runner, run)
        finally:
            del runner
            free_device_memory(run.args)


def steps_decode(shape: str, runner: ModelRunner, batches: list[int], per_seq: int, run: Run) -> None:
    for batch in batches:
        if not run.budget.allows(5.0):
            run.skip(f"{shape} decode batch {batch}", "budget spent")
            continue
        row = measure_decode(runner, batch, run, per_seq)
        run.shape(shape).setdefault("decode", []).append(row)
        graph = f"{row['graph_s'] * 1e3:.2f} ms" if row["graph_s"] is not None else f"n/a ({row['graph_note']})"
        log(f"   decode batch {batch}: execute() {row['execute_s_median'] * 1e3:.2f} ms median, graph {graph}")


def steps_prefill(shape: str, runner: ModelRunner, run: Run) -> None:
    if not run.budget.allows(5.0):
        run.skip(f"{shape} prefill", "budget spent")
        return
    graphs = runner.graphs
    mixed = list(graphs.mixed_tokens) if graphs is not None else []
    for tokens in run.args.prefill_tokens:
        modes = ["graph", "eager"] if mixed and tokens <= mixed[-1] else ["eager"]
        for mode in modes:
            if graphs is not None and mixed:
                # The same runner with its mixed-step graphs set aside: the eager path, side by side.
                graphs.mixed_tokens = mixed if mode == "graph" else []
            row = measure_prefill(runner, run, tokens)
            row["mode"] = mode
            run.shape(shape).setdefault("prefill", []).append(row)
            log(f"   prefill {row['tokens']} tokens ({mode}): execute() {row['execute_s_median'] * 1e3:.2f} ms "
                f"median (first {row['first_s'] * 1e3:.1f} ms)")
        if graphs is not None and mixed:
            graphs.mixed_tokens = mixed
    if run.args.profile and is_cuda(run.args):
        profile_steps(shape, runner, run)
    if run.args.host_profile:
        host_profile_steps(shape, runner, run)
