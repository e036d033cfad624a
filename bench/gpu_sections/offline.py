"""The offline section: offline-64 replayed by `jitney bench` against a fresh `jitney serve` per case."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu_sections.plumbing import ROOT, Run, dtype_name, env_var, is_cuda, load_items, log, write_items

SLOW_STEP_S = 0.05
CPU_SERVER_FLAGS = ["--num-blocks", "1024"]


def trace_stats(path: Path) -> dict[str, Any]:
    """Step count, longest step and the first two steps' ``dur`` (seconds) of a step trace."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    durs = [float(s["dur"]) for s in steps]
    return {"steps": len(steps), "max_step_s": max(durs, default=0.0), "first_steps_s": durs[:2],
            "steps_over_50ms": sum(d > SLOW_STEP_S for d in durs),
            "model_s_total": sum(float(s.get("model_s", 0.0)) for s in steps)}


def startup_lines(server_log: str) -> list[str]:
    """The server's own start-up lines ("jitney: ready on ...", warm-up, step budget)."""
    keys = ("jitney:", "warm", "budget", "seats", "KV cache", "loaded")
    lines = [ln.strip() for ln in server_log.splitlines() if any(k in ln for k in keys)]
    return lines[:8]


def server_flags(model: Path, trace: Path, case_flags: list[str], args: argparse.Namespace) -> list[str]:
    flags = ["--model", str(model), "--device", args.device, "--dtype", dtype_name(args), "--trace", str(trace)]
    return flags + ([] if is_cuda(args) else CPU_SERVER_FLAGS) + case_flags


def replay(target: str, workload: Path, out: Path, timeout: float) -> dict[str, Any]:
    """`jitney bench` against ``target``; its JSON summary with ``exit_code`` and ``completed``."""
    cmd = [sys.executable, "-m", "jitney.cli", "bench", "--target", target, "--workload", str(workload),
           "--json", str(out), "--no-progress"]
    code = subprocess.run(cmd, cwd=ROOT, timeout=max(1.0, timeout)).returncode
    summary: dict[str, Any] = json.loads(out.read_text())
    summary["exit_code"] = code
    summary["completed"] = summary["requests"] - summary["errors"]
    return summary


def run_server_case(name: str, model: Path, case_flags: list[str], workload: Path, run: Run,
                    triton_cache: str | None) -> dict[str, Any]:
    """A fresh `jitney serve` with ``case_flags`` until ``workload`` is replayed; summary + trace stats."""
    from tests.support.server_harness import running_server

    slug = name.split(" ")[0] + ("-fresh" if "fresh" in name else "-warm" if "warm" in name else "")
    trace = run.workdir / f"{model.name}-{slug}.trace.jsonl"
    flags = server_flags(model, trace, case_flags, run.args)
    log(f"== {model.name} {name}: jitney serve {' '.join(case_flags) or '(default flags)'}")
    started = time.monotonic()
    with env_var("TRITON_CACHE_DIR", triton_cache), \
            running_server(flags, run.workdir, startup_timeout=max(1.0, run.budget.left())) as server:
        startup_s = time.monotonic() - started
        summary = replay(server.target, workload, run.workdir / f"{model.name}-{slug}.json", run.budget.left())
        lines = startup_lines(server.log())
    summary.update(case=name, flags=case_flags, startup_s=startup_s, startup_lines=lines, trace=str(trace),
                   server_log=str(server.log_path), **trace_stats(trace))
    log(f"   wall {summary['wall_s']:.2f} s, {summary['completed']}/{summary['requests']} completed, "
        f"{summary['steps']} steps, longest {summary['max_step_s'] * 1e3:.1f} ms, start-up {startup_s:.1f} s")
    return summary


def offline_cases(run: Run) -> list[tuple[str, list[str], str | None]]:
    """(name, flags, TRITON_CACHE_DIR) of each offline case, in order."""
    static = ["--policy", "static", "--max-num-seqs", "8"]
    wanted = run.args.offline_cases
    cases: list[tuple[str, list[str], str | None, bool]]
    if not is_cuda(run.args):   # no Triton kernels on CPU: fresh and warm are the same case
        cases = [("default", [], None, "fresh" in wanted or "warm" in wanted), ("static-8", static, None, "static" in wanted)]
    else:
        cache = run.triton_cache = tempfile.mkdtemp(prefix="jitney-triton-cache-")   # not under workdir (may be $OUT)
        cases = [("default (fresh Triton cache)", [], cache, "fresh" in wanted),
                 ("default (warm)", [], cache, "warm" in wanted), ("static-8", static, cache, "static" in wanted)]
    return [(name, flags, cache_dir) for name, flags, cache_dir, chosen in cases if chosen]


def section_offline(shape: str, model: Path, run: Run) -> None:
    items = load_items(run.args, "offline-64.jsonl")
    workload = write_items(items, run.workdir / f"offline-64-{len(items)}.jsonl")
    results = run.shape(shape).setdefault("offline", [])
    for name, flags, cache in offline_cases(run):
        if not run.budget.allows(run.args.server_reserve_s):
            run.skip(f"{shape} offline {name}", f"{run.budget.left():.0f} s left of the budget")
            continue
        try:
            case = run_server_case(name, model, flags, workload, run, cache)
            results.append(case)
            if case["errors"] or case["exit_code"]:
                run.errors.append(f"{shape} offline {name}: {case['errors']} of {case['requests']} requests "
                                  f"failed (`jitney bench` exit {case['exit_code']}); log in {run.workdir}")
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            run.errors.append(f"{shape} offline {name}: {type(exc).__name__}: {str(exc)[-2000:]}")
            log(f"!! {shape} offline {name} failed: {exc}")
