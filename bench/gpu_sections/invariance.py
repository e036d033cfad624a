"""The invariance section: ``--batch-invariant`` off and on, what differs and what it costs."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_sections.measure import (blocks_for, decode_batches, make_runner, measure_decode, measure_prefill,
                                        runner_blocks)
from bench.gpu_sections.offline import run_server_case
from bench.gpu_sections.plumbing import (Run, cpu_threads, dtype_name, env_var, free_device_memory, is_cuda,
                                         load_items, log, write_items)
from bench.gpu_sections.tables import fmt_ms, on_off

if TYPE_CHECKING:
    from tests.support.invariance_driver import Output, Request
    from jitney.worker.runner.model_runner import ModelRunner

INVARIANCE_TEMPERATURE, INVARIANCE_TOP_P, INVARIANCE_SEED = 0.8, 0.9, 1000
INVARIANCE_PREEMPT = {6: [0], 13: [3]}   # before step s, preempt the running requests at these positions
INVARIANCE_RULE = 1.10                   # default --batch-invariant on for CUDA when on/off <= this


def _prompt_ids(start: int, n: int) -> tuple[int, ...]:
    return tuple(5 + (7919 * (start + k) + 104729 * ((start + k) // 97)) % 40000 for k in range(n))


def invariance_prompts(n: int, longest: int) -> list[tuple[int, ...]]:
    """``n`` prompts (token ids) of lengths spread geometrically from 1 to ``longest``; the even
    ones are prefixes of one token stream (prefix-cache hits across prompts), the odd ones their own."""
    lengths = [max(1, round(longest ** (i / max(1, n - 1)))) for i in range(n)]
    return [_prompt_ids(0 if i % 2 == 0 else 50_000 * i, length) for i, length in enumerate(lengths)]


def invariance_jobs(prompts: list[tuple[int, ...]], max_tokens: int) -> list[Request]:
    """Each prompt greedy and seeded (T 0.8, top_p 0.9, its own seed in every request)."""
    from tests.support.invariance_driver import Request

    jobs = []
    for i, prompt in enumerate(prompts):
        jobs.append(Request(prompt, max_tokens))
        jobs.append(Request(prompt, max_tokens, temperature=INVARIANCE_TEMPERATURE, top_p=INVARIANCE_TOP_P,
                            seed=INVARIANCE_SEED + i))
    return jobs


def invariance_arrivals(requests: list[Request]) -> dict[int, list[tuple[int, Request]]]:
    """Waves of 1, 2, 4, 8, ... requests, one every 2 steps: prefills land among running decodes."""
    at: dict[int, list[tuple[int, Request]]] = {}
    first, size, step = 0, 1, 0
    while first < len(requests):
        at[step] = [(rid, requests[rid]) for rid in range(first, min(len(requests), first + size))]
        first, size, step = first + size, size * 2, step + 2
    return at


def invariance_blocks(run: Run, requests: int, prompts: list[tuple[int, ...]], block_size: int = 16) -> int:
    """KV blocks for every request at once (no prefix sharing counted) and for the step measurements."""
    per_request = max(blocks_for(len(p) + run.args.invariance_tokens, block_size) for p in prompts)
    _, steps = runner_blocks(run, invariance_step_batches(run.args), block_size)
    return max(requests * per_request + 16, steps)


def invariance_step_batches(args: argparse.Namespace) -> list[int]:
    """Decode batches of the cost measurement: 1 and the largest --batch (64), capped like decode's."""
    return decode_batches(argparse.Namespace(batch=[1, max(args.batch)], limit=args.limit))


def compare_outputs(ref: Output, got: Output) -> tuple[bool, bool, float]:
    """(token ids differ, log-probs differ, largest |logprob difference| before the first other token)."""
    agree = next((k for k, (a, b) in enumerate(zip(ref.tokens, got.tokens)) if a != b), len(ref.tokens))
    delta = max((abs(a - b) for a, b in zip(ref.logprobs[:agree], got.logprobs[:agree])), default=0.0)
    return ref.tokens != got.tokens, ref.logprobs != got.logprobs, delta


def invariance_experiment(shape: str, runner: ModelRunner, flag: bool, run: Run) -> list[dict[str, Any]]:
    """The jobs alone (the reference), then the requests batched at each budget; one row per budget."""
    import random

    from tests.support.invariance_driver import BatchDriver, first_difference, preempt_by_position, run_alone

    args = run.args
    prompts = invariance_prompts(args.invariance_prompts, args.invariance_longest)
    jobs = invariance_jobs(prompts, args.invariance_tokens)
    started = time.perf_counter()
    alone = {job: run_alone(runner, job) for job in jobs}
    alone_s = time.perf_counter() - started
    requests = [jobs[k % len(jobs)] for k in range(args.invariance_requests)]
    random.Random(0).shuffle(requests)
    rows = []
    for budget in args.invariance_budgets:
        if budget > runner.limits.max_num_batched_tokens:
            run.skip(f"{shape} invariance budget {budget}",
                     f"over the runner's step budget {runner.limits.max_num_batched_tokens}")
            continue
        started = time.perf_counter()
        driver = BatchDriver(runner, budget=budget)
        outputs = driver.run(invariance_arrivals(requests), preempt=preempt_by_position(INVARIANCE_PREEMPT))
        seconds = time.perf_counter() - started
        row: dict[str, Any] = {
            "batch_invariant": flag, "budget": budget, "requests": len(outputs), "tokens_differ": 0,
            "logprobs_differ": 0, "max_logprob_delta": 0.0, "alone_s": alone_s, "seconds": seconds,
            "steps": len(driver.steps), "largest_step_seqs": max(s.seqs for s in driver.steps),
            "cached_prompt_tokens": sum(o.cached_tokens for o in outputs.values()),
            "preemptions": sum(len(o.preempted_after) for o in outputs.values()), "examples": []}
        for rid, got in sorted(outputs.items()):
            ref = alone[got.request]
            tokens, logprobs, delta = compare_outputs(ref, got)
            row["tokens_differ"] += tokens
            row["logprobs_differ"] += logprobs
            row["max_logprob_delta"] = max(row["max_logprob_delta"], delta)
            if logprobs and len(row["examples"]) < 3:
                row["examples"].append(f"request {rid} ({got.request.describe()}): {first_difference(ref, got)}")
        rows.append(row)
        log(f"   invariance {'on' if flag else 'off'}, budget {budget}: {row['requests']} requests in "
            f"{row['steps']} steps ({seconds:.1f} s), {row['tokens_differ']} differ in token ids, "
            f"{row['logprobs_differ']} in log-probs")
    return rows


def invariance_steps(runner: ModelRunner, flag: bool, round_no: int, run: Run) -> list[dict[str, Any]]:
    """Decode at batch 1 and 64, one prefill step of the largest --prefill-tokens (2048): rows tagged."""
    per_seq, _ = runner_blocks(run, invariance_step_batches(run.args))
    rows = [{"what": f"decode batch {b}", **measure_decode(runner, b, run, per_seq)}
            for b in invariance_step_batches(run.args)]
    graphs = runner.graphs
    mixed = list(graphs.mixed_tokens) if graphs is not None else []
    tokens = max(run.args.prefill_tokens)
    if graphs is not None and mixed and tokens <= mixed[-1]:
        graphs.mixed_tokens = []    # eager, as a step over the graphs' largest is
    try:
        rows.append({"what": f"prefill {tokens} tokens", **measure_prefill(runner, run, tokens)})
    finally:
        if graphs is not None:
            graphs.mixed_tokens = mixed
    for row in rows:
        row.update(batch_invariant=flag, round=round_no)
    return rows


def section_invariance(shape: str, model: Path, run: Run) -> None:
    """--batch-invariant off and on: the experiment on ModelRunners, their step costs, offline-64 servers."""
    args = run.args
    data = run.shape(shape).setdefault("invariance", {})
    prompts = invariance_prompts(args.invariance_prompts, args.invariance_longest)
    data["config"] = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                      "jobs": 2 * len(prompts), "requests": args.invariance_requests,
                      "max_tokens": args.invariance_tokens, "budgets": args.invariance_budgets,
                      "temperature": INVARIANCE_TEMPERATURE, "top_p": INVARIANCE_TOP_P,
                      "seeds": f"{INVARIANCE_SEED} + prompt index", "preempt": INVARIANCE_PREEMPT,
                      "rounds": args.invariance_rounds, "dtype": dtype_name(args)}
    data.update(rows=[], runners=[], steps=[])
    if is_cuda(args) and run.triton_cache is None:
        run.triton_cache = tempfile.mkdtemp(prefix="jitney-triton-cache-")   # the servers below read it warm
    with env_var("TRITON_CACHE_DIR", run.triton_cache), cpu_threads(1 if not is_cuda(args) else None):
        try:
            invariance_runners(shape, model, run, data)
        finally:
            free_device_memory(args)
    for what in dict.fromkeys(row["what"] for row in data["steps"]):
        medians = {flag: step_median(data["steps"], what, flag) for flag in (False, True)}
        log(f"   {what}: " + ", ".join(f"{on_off(flag)} {fmt_ms(m)} ms" for flag, m in medians.items()))
    if shape in args.invariance_offline_shapes:
        invariance_offline(shape, model, run, data)
    else:
        run.notes.append(f"{shape} invariance: no offline-64 pair (only for "
                         f"{', '.join(args.invariance_offline_shapes) or 'no shape'}: --invariance-offline-shapes)")


def invariance_runners(shape: str, model: Path, run: Run, data: dict[str, Any]) -> None:
    """A runner per setting (both kept): the experiment on each, then their step timings, alternating."""
    args = run.args
    total = invariance_blocks(run, args.invariance_requests, invariance_prompts(args.invariance_prompts,
                                                                                args.invariance_longest))
    runners: dict[bool, ModelRunner] = {}
    for flag in (False, True):
        if not run.budget.allows(args.invariance_reserve_s):
            run.skip(f"{shape} invariance {on_off(flag)}", f"{run.budget.left():.0f} s left of the budget")
            continue
        try:
            started = time.perf_counter()
            runner = make_runner(model, run, None, total, batch_invariant=flag)
            info = {"batch_invariant": flag, "resolved": runner.batch_invariant,
                    "init_s": time.perf_counter() - started, "warmup_s": getattr(runner, "warmup_seconds", None)}
            data["runners"].append(info)
            log(f"== {shape} invariance: ModelRunner --{'' if flag else 'no-'}batch-invariant ready in "
                f"{info['init_s']:.1f} s ({total} KV blocks)")
            data["rows"] += invariance_experiment(shape, runner, flag, run)
            runners[flag] = runner
        except Exception as exc:  # noqa: BLE001 - recorded with its traceback; the other setting still runs
            run.errors.append(f"{shape} invariance {on_off(flag)}: {type(exc).__name__}: {str(exc)[-2000:]}")
            log(f"!! {shape} invariance {on_off(flag)} failed:\n{traceback.format_exc()}")
    try:
        for round_no in range(1, args.invariance_rounds + 1):   # off, on, off, on: drift falls on both
            for flag in list(runners):
                if not run.budget.allows(5.0):
                    run.skip(f"{shape} invariance steps ({on_off(flag)}, round {round_no})", "budget spent")
                    continue
                data["steps"] += invariance_steps(runners[flag], flag, round_no, run)
    except Exception as exc:  # noqa: BLE001 - recorded; the offline pair still runs
        run.errors.append(f"{shape} invariance steps: {type(exc).__name__}: {str(exc)[-2000:]}")
        log(f"!! {shape} invariance steps failed:\n{traceback.format_exc()}")


def invariance_offline(shape: str, model: Path, run: Run, data: dict[str, Any]) -> None:
    """offline-64 on `jitney serve --no-batch-invariant` and `--batch-invariant`, alternating."""
    items = load_items(run.args, "offline-64.jsonl")
    workload = write_items(items, run.workdir / f"offline-64-{len(items)}.jsonl")
    cases = data.setdefault("offline", [])
    for round_no in range(1, run.args.invariance_rounds + 1):
        for flag in (False, True):
            name = f"invariant-{'on' if flag else 'off'}-{round_no}"
            if not run.budget.allows(run.args.server_reserve_s):
                run.skip(f"{shape} invariance offline {name}", f"{run.budget.left():.0f} s left of the budget")
                continue
            flags = ["--batch-invariant" if flag else "--no-batch-invariant"]
            try:
                case = run_server_case(name, model, flags, workload, run, run.triton_cache)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                run.errors.append(f"{shape} invariance offline {name}: {type(exc).__name__}: {str(exc)[-2000:]}")
                log(f"!! {shape} invariance offline {name} failed: {exc}")
                continue
            case.update(batch_invariant=flag, round=round_no)
            cases.append(case)
            if case["errors"] or case["exit_code"]:
                run.errors.append(f"{shape} invariance offline {name}: {case['errors']} of {case['requests']} "
                                  f"requests failed (`jitney bench` exit {case['exit_code']})")
    ratio = offline_ratio(cases)
    if ratio is not None:
        data["offline_wall_ratio"] = ratio
        log(f"   offline-64 wall, batch-invariant on / off (medians): {ratio:.3f}")


def step_median(steps: list[dict[str, Any]], what: str, flag: bool) -> float | None:
    """The median over rounds of a step's per-round medians, or None."""
    got = [r["execute_s_median"] for r in steps if r["what"] == what and r["batch_invariant"] == flag]
    return statistics.median(got) if got else None


def offline_median(cases: list[dict[str, Any]], flag: bool) -> float | None:
    walls = [c["wall_s"] for c in cases if c["batch_invariant"] == flag and not c["errors"]]
    return statistics.median(walls) if walls else None


def offline_ratio(cases: list[dict[str, Any]]) -> float | None:
    """Median offline-64 wall with --batch-invariant / median without; None without both."""
    on, off = offline_median(cases, True), offline_median(cases, False)
    return on / off if on is not None and off else None
