#!/usr/bin/env python3
"""Issue 15's benchmark: the CPU step against its bf16 matmul floor, int8, int4 and llama.cpp, in one run.

    .venv/bin/python bench/cpu_floor.py [--cases NAME ...] [--limit N] [--out FILE] [--json FILE]
    .venv/bin/python bench/cpu_floor.py --smoke        # a tiny random model, a few requests, seconds

Everything below runs side by side in one process's run, one thing at a time:

* ``floor``: the machine's bf16 matmul throughput on the model's own linear
  shapes at ``--floor-rows`` rows (512), through the worker's own kernel
  (``cpu_kernels.InvariantLinear``) and through ``F.linear``. The FLOPs of
  offline-64 are counted from the workload file and the model's config
  (``workload_flops``), per shape; each kernel's throughput over that mix
  (FLOPs / the time each shape's share takes at its measured rate) is
  taken, and the better kernel's is the peak. Floor seconds = FLOPs / peak
  (attention counted at the same peak).
* ``bf16-offline``, ``bf16-online``, ``int8-offline``, ``int8-online``,
  ``int4-offline``, ``int4-online``, ``static-8``: a fresh `jitney serve` per case with its flags, replayed by
  `jitney bench` (``bench/run_benchmarks.run_server_case``).
* ``decode-bf16``, ``decode-int8``, ``decode-int4``: the worker's decode step at batch 1/8/64
  (``bench/decode_step.measure``), model ms and execute ms.
* ``llama-offline``, ``llama-online``: llama.cpp's `llama-server` on the
  bundled GGUF (``bench/llama_server.py``), only where it is on the PATH.

A case that fails (e.g. ``--quantization int8`` before the worker has it) is
reported as failed, with the reason, and the run goes on; the exit status is
then 1. The targets' "met"/"missed" are computed from this run's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llama_server  # noqa: E402
from bench.cpu_floor_measure import failure_reason, floor_pass, run_decodes  # noqa: E402
from bench.cpu_floor_model import (kv_bytes_per_token, model_config, step_floors, weight_bytes,  # noqa: E402
                                   workload_bytes, workload_flops)
from bench.cpu_floor_report import render, targets  # noqa: E402
from bench.run_benchmarks import WORKLOADS, computed_prompt_tokens, run_server_case  # noqa: E402
from jitney.client.bench import load_workload  # noqa: E402
from jitney.scheduler.core.trace import read_trace  # noqa: E402
from jitney.worker.models.llama import ModelConfig  # noqa: E402

BF16 = ["--dtype", "auto"]
INT8 = ["--dtype", "auto", "--quantization", "int8"]
INT4 = ["--dtype", "auto", "--quantization", "int4"]
# name -> (workload, jitney serve flags)
SERVER_CASES: dict[str, tuple[str, list[str]]] = {
    "bf16-offline": ("offline-64.jsonl", BF16),
    "bf16-online": ("online-64.jsonl", BF16),
    "int8-offline": ("offline-64.jsonl", INT8),
    "int8-online": ("online-64.jsonl", INT8),
    "int4-offline": ("offline-64.jsonl", INT4),
    "int4-online": ("online-64.jsonl", INT4),
    "static-8": ("offline-64.jsonl", [*BF16, "--policy", "static", "--max-num-seqs", "8"]),
}
DECODE_CASES: dict[str, dict[str, Any]] = {"decode-bf16": {}, "decode-int8": {"quantization": "int8"},
                                           "decode-int4": {"quantization": "int4"}}
LLAMA_CASES = {"llama-offline": "offline-64.jsonl", "llama-online": "online-64.jsonl"}
ALL_CASES = ["floor", *DECODE_CASES, *SERVER_CASES, *LLAMA_CASES]
DECODE_BATCHES = (1, 8, 64)
# bf16 serving cases whose step traces are read against each step's floor (``step_floors``)
STEP_FLOOR_CASES = ("bf16-offline", "static-8")


# ---------------------------------------------------------------- cases

def limited(path: Path, limit: int | None, workdir: Path) -> Path:
    """``path`` itself, or its first ``limit`` requests (by arrival) written to ``workdir``."""
    if not limit:
        return path
    out = workdir / f"{path.stem}.first{limit}.jsonl"
    rows = [{"id": i.id, "arrival_s": i.arrival_s, "prompt_token_ids": i.prompt_token_ids,
             "max_tokens": i.max_tokens} for i in load_workload(path)[:limit]]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def smoke_setup(workdir: Path) -> tuple[str, dict[str, Path]]:
    """A tiny random Llama and two small workloads in the format of bench/workloads/."""
    from tests.support.tiny_models import make_tiny_llama

    model = make_tiny_llama(workdir / "tiny-model", max_position_embeddings=512)
    shapes = {"offline-64.jsonl": [(0.0, 24, 12), (0.0, 9, 20), (0.0, 40, 6), (0.0, 16, 16)],
              "online-64.jsonl": [(0.0, 12, 10), (0.15, 30, 8), (0.3, 7, 12), (0.45, 20, 6)]}
    workloads = {}
    for name, rows in shapes.items():
        path = workdir / f"smoke-{name}"
        path.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": t, "max_tokens": m,
                                            "prompt_token_ids": [(11 * i + 7 * j) % 300 + 3 for j in range(p)]})
                                + "\n" for i, (t, p, m) in enumerate(rows)))
        workloads[name] = path
    return str(model), workloads


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=ALL_CASES, default=None, metavar="CASE",
                        help=f"what to run (default: all): {', '.join(ALL_CASES)}")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random model (tests/support/tiny_models.py) and 4-request workloads: a plumbing check")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="replay only the first N requests of each workload (plumbing checks; the floor "
                             "then counts those N)")
    parser.add_argument("--floor-rows", type=int, default=512, help="rows of the peak matmuls")
    parser.add_argument("--floor-reps", type=int, default=5)
    parser.add_argument("--decode-context", type=int, default=100)
    parser.add_argument("--decode-reps", type=int, default=10)
    parser.add_argument("--decode-rounds", type=int, default=3,
                        help="rounds of the decode cases, the modes taking turns (median over rounds)")
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server's slots (-np)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "cpu_floor")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="write every figure as JSON here")
    args = parser.parse_args(argv)
    wanted = args.cases or ALL_CASES
    args.workdir.mkdir(parents=True, exist_ok=True)

    model: str | None = None
    workloads = {name: WORKLOADS / name for name in ("offline-64.jsonl", "online-64.jsonl")}
    model_flags: list[str] = []
    if args.smoke:
        model, workloads = smoke_setup(args.workdir)
        model_flags = ["--model", model, "--num-blocks", "256"]
        args.floor_rows, args.floor_reps = min(args.floor_rows, 64), min(args.floor_reps, 3)
        args.decode_context, args.decode_reps = min(args.decode_context, 16), min(args.decode_reps, 2)
        args.decode_rounds = 1
    import torch

    res: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "model": "tiny random Llama (tests/support/tiny_models.py)" if args.smoke else "the bundled default "
                 "(SmolLM2-135M-Instruct, GGUF)",
        "smoke": args.smoke, "limit": args.limit, "cases": {}, "decode": {}, "floor": None, "llama_note": None,
        "step_floors": {},
    }

    cfg: ModelConfig | None = None  # read once, by the first part that needs it
    if "floor" in wanted:
        print("== floor: bf16 matmul peak on the model's shapes", flush=True)
        try:
            cfg = model_config(model)
            offline = load_workload(limited(workloads["offline-64.jsonl"], args.limit, args.workdir))
            flops = workload_flops(cfg, offline)
            res["floor"] = floor_pass(cfg, flops, args.floor_rows, args.floor_reps,
                                      data=workload_bytes(cfg, offline), bandwidth_mb=64 if args.smoke else 512)
            print(f"  peak {res['floor']['peak']['peak_gflops']:.0f} GFLOP/s, {flops['total'] / 1e9:.1f} GFLOP, "
                  f"floor {res['floor']['floor_s']:.2f} s; read bandwidth {res['floor']['bandwidth_gbs']:.1f} GB/s, "
                  f"bytes floor {res['floor']['bytes_floor_s']:.2f} s", flush=True)
        except Exception as err:  # noqa: BLE001 - reported, the run goes on
            traceback.print_exc()
            res["floor"] = {"error": failure_reason(err)}

    decode_configs = {name: config for name, config in DECODE_CASES.items() if name in wanted}
    if decode_configs:
        print(f"== {', '.join(decode_configs)}: decode step at batch {', '.join(map(str, DECODE_BATCHES))}, "
              f"{args.decode_rounds} rounds in turns", flush=True)
        res["decode"].update(run_decodes(model, decode_configs, DECODE_BATCHES, args.decode_context,
                                         args.decode_reps, args.decode_rounds))

    for name, (workload, flags) in SERVER_CASES.items():
        if name not in wanted:
            continue
        path = limited(workloads[workload], args.limit, args.workdir)
        all_flags = [*flags, *model_flags]
        try:
            summary = run_server_case(name, path, all_flags, args.workdir)
            summary["workload"] = workload
            summary["computed_prompt_tokens"] = computed_prompt_tokens(Path(summary["trace"]))
            summary.pop("server_stats", None)
            if summary["errors"] or summary["exit_code"]:
                summary = {"error": f"{summary['errors']} request errors, jitney bench exit {summary['exit_code']}",
                           "flags": all_flags, "summary": summary}
        except Exception as err:  # noqa: BLE001
            summary = {"error": failure_reason(err), "flags": all_flags}
        if "error" in summary:
            print(f"  {name} FAILED: {summary['error']}", flush=True)
        res["cases"][name] = summary

    llama_wanted = [n for n in LLAMA_CASES if n in wanted]
    if llama_wanted:
        exe = llama_server.binary()
        if exe is None:
            res["llama_note"] = "llama-server not on PATH, skipped"
        elif args.smoke:
            res["llama_note"] = "skipped in the smoke run (the tiny model has no GGUF)"
        else:
            from jitney.common.model_files import resolve_model

            files = resolve_model(None)
            gguf = files.directory / (files.gguf_file or "")
            res["llama_note"] = f"{exe}, {gguf.name}, {args.llama_parallel} slots"
            for name in llama_wanted:
                print(f"== {name}: {exe}", flush=True)
                items = load_workload(limited(workloads[LLAMA_CASES[name]], args.limit, args.workdir))
                try:
                    summary = llama_server.run_case(items, gguf, args.workdir, parallel=args.llama_parallel,
                                                    threads=torch.get_num_threads(), exe=exe)
                    summary["workload"] = LLAMA_CASES[name]
                    if summary["errors"]:
                        summary = {"error": f"{summary['errors']} request errors: {summary['failed_requests']}",
                                   "flags": summary["flags"], "summary": summary}
                except Exception as err:  # noqa: BLE001
                    summary = {"error": failure_reason(err), "flags": [llama_server.BINARY]}
                res["cases"][name] = summary

    if res["floor"] and "error" not in res["floor"]:
        assert cfg is not None  # the floor's first pass read it
        print("== floor: the matmul peak again, at the end of the run", flush=True)
        res["floor"] = floor_pass(cfg, res["floor"]["flops"], args.floor_rows, args.floor_reps, res["floor"])
        fl = res["floor"]
        for name in STEP_FLOOR_CASES:
            case = res["cases"].get(name) or {}
            if "trace" in case and "error" not in case:
                res["step_floors"][name] = step_floors(cfg, read_trace(Path(case["trace"])),
                                                       fl["peak"]["peak_gflops"], fl["bandwidth_gbs"])
    if res["decode"]:
        try:
            cfg = cfg or model_config(model)
            kv = kv_bytes_per_token(cfg) * args.decode_context
            res["decode_bytes"] = {"context": args.decode_context, "kv": kv,
                                   **{kind: weight_bytes(cfg, kind) for kind in ("bf16", "int8")}}
        except Exception:  # noqa: BLE001 - the bound is a note; the decode cases carry their own errors
            traceback.print_exc()
    res["targets"] = targets(res)
    report = render(res)
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    failed = [n for n, c in [*res["cases"].items(), *res["decode"].items()] if "error" in c]
    if res["floor"] and "error" in res["floor"]:
        failed.append("floor")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
