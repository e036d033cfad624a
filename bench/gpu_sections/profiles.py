"""Where a step's time goes (``--profile``, ``--host-profile``): torch.profiler and cProfile tables."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.gpu_sections.measure import (blocks_for, decode_batches, decode_plan, decodes_ready, prompt_plan,
                                        runner_blocks)
from bench.gpu_sections.plumbing import Run, log

if TYPE_CHECKING:
    from jitney.worker.runner.model_runner import ModelRunner


def profile_steps(shape: str, runner: ModelRunner, run: Run) -> None:
    """torch.profiler over decode steps (batch 1 and the largest) and a 2048-token prefill: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from jitney.engine.v1 import engine_pb2 as e

    out = (run.args.out.parent if run.args.out else Path(".")) / f"profile-{shape}.txt"
    per_seq, _ = runner_blocks(run, [])
    texts = []
    for batch in sorted({1, max(decode_batches(run.args))}):
        decodes_ready(runner, batch, run, per_seq)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(3, 8):
                runner.execute(decode_plan(batch, run.args.context + k))
        runner.execute(e.StepPlan(step_id=10_000, freed_seq_ids=list(range(1, batch + 1))))
        texts.append(f"== decode batch {batch}, 5 steps, by CPU total\n"
                     + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        texts.append(f"== decode batch {batch}, 5 steps, by device total\n"
                     + prof.key_averages().table(sort_by="device_time_total", row_limit=25))
    tokens = max(run.args.prefill_tokens)
    ids, blocks = [100 + j % 40000 for j in range(tokens)], list(range(blocks_for(tokens, 16)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for rep in range(2):
            runner.execute(prompt_plan(40_000 + rep, 60_000 + rep, ids, blocks))
            runner.execute(e.StepPlan(step_id=41_000 + rep, freed_seq_ids=[60_000 + rep]))
    texts.append(f"== prefill {tokens} tokens, 2 steps, by device total\n"
                 + prof.key_averages().table(sort_by="device_time_total", row_limit=30))
    out.write_text("\n\n".join(texts))
    log(f"   profile: {out}")


def host_profile_steps(shape: str, runner: ModelRunner, run: Run) -> None:
    """cProfile of ``execute()``: decode steps (batch 1 and the largest) and prefill steps of the
    largest --prefill-tokens, by own time and by cumulative time: where the host's time goes."""
    import cProfile
    import pstats

    from jitney.engine.v1 import engine_pb2 as e

    out = (run.args.out.parent if run.args.out else Path(".")) / f"host-profile-{shape}.txt"
    per_seq, _ = runner_blocks(run, [])
    steps = max(5, run.args.reps)
    texts = []

    def table(prof: cProfile.Profile, title: str, per: int) -> None:
        """The 30 functions of most own time and of most cumulative time, in µs per step."""
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        rows = [(tt, ct, nc, f"{Path(file).name}:{line}({name})") for (file, line, name), (_, nc, tt, ct, _)
                in stats.items()]
        for key, index in (("own", 0), ("cumulative", 1)):
            lines = [f"== {title}, by {key} time (µs per step)", f"{'own':>9} {'cum':>9} {'calls':>7}  function"]
            for tt, ct, nc, where in sorted(rows, key=lambda r: -float(r[index]))[:30]:
                lines.append(f"{tt / per * 1e6:9.1f} {ct / per * 1e6:9.1f} {nc / per:7.1f}  {where}")
            texts.append("\n".join(lines))

    for batch in sorted({1, max(decode_batches(run.args))}):
        decodes_ready(runner, batch, run, per_seq)
        prof = cProfile.Profile()
        started = time.perf_counter()
        prof.enable()
        for k in range(3, 3 + steps):
            runner.execute(decode_plan(batch, run.args.context + k))
        prof.disable()
        elapsed = (time.perf_counter() - started) / steps
        runner.execute(e.StepPlan(step_id=10_000, freed_seq_ids=list(range(1, batch + 1))))
        table(prof, f"decode batch {batch}, {steps} steps ({elapsed * 1e3:.2f} ms a step under cProfile)", steps)
    tokens = max(run.args.prefill_tokens)
    ids, blocks = [100 + j % 40000 for j in range(tokens)], list(range(blocks_for(tokens, 16)))
    prof = cProfile.Profile()
    for rep in range(3):
        plan = prompt_plan(42_000 + rep, 62_000 + rep, ids, blocks)
        if rep:
            prof.enable()
        runner.execute(plan)
        prof.disable()
        runner.execute(e.StepPlan(step_id=43_000 + rep, freed_seq_ids=[62_000 + rep]))
    table(prof, f"prefill {tokens} tokens, 2 steps", 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(texts))
    log(f"   host profile: {out}")
