#!/usr/bin/env python3
"""Run Jitney's benchmarks side by side in one run and write docs/benchmarks.md.

    .venv/bin/python bench/run_benchmarks.py [--only NAME ...] [--out docs/benchmarks.md]

Each case starts a fresh `jitney serve` with its flags, replays a workload of
bench/workloads/ with `jitney bench` (every request greedy, ignore_eos, exactly
max_tokens), records the summary, and stops the server. The Hugging Face
baseline runs transformers' `generate` on the same requests in static batches
of 8 (fp32, left padding). Ratios are computed between cases of this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "bench" / "workloads"
sys.path.insert(0, str(ROOT))

from bench.report import render  # noqa: E402
from jitney.client.bench import WorkItem, load_workload  # noqa: E402
from tests.support.server_harness import running_server  # noqa: E402


def run_server_case(name: str, workload: Path, flags: list[str], workdir: Path) -> dict[str, Any]:
    """`jitney serve FLAGS --trace` until `jitney bench` has replayed ``workload``."""
    from google.protobuf.json_format import MessageToDict

    trace = workdir / f"{name}.trace.jsonl"
    with running_server(["--trace", str(trace), *flags], workdir, startup_timeout=300) as server:
        out = workdir / f"{name}.json"
        bench = [sys.executable, "-m", "jitney.cli", "bench", "--target", server.target, "--workload",
                 str(workload), "--json", str(out), "--no-progress"]
        print(f"== {name}: jitney serve {' '.join(flags)}", flush=True)
        code = subprocess.run(bench, cwd=ROOT).returncode
        summary = json.loads(out.read_text())
        summary["exit_code"] = code
        summary["server_stats"] = MessageToDict(server.stats(), preserving_proto_field_name=True,
                                                always_print_fields_with_no_presence=True)
    summary["flags"] = flags
    summary["trace"] = str(trace)
    return summary


def run_hf_baseline(items: list[WorkItem], batch_size: int = 8) -> dict[str, Any]:
    """transformers' generate in static batches of 8, fp32, left padding, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    from jitney.common.model_files import resolve_model

    files = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(str(files.directory), dtype=torch.float32,
                                                 **files.pretrained_kwargs()).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    print(f"== hf-generate: static batches of {batch_size}, fp32", flush=True)
    output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(items), batch_size):
            batch = items[i:i + batch_size]
            width = max(len(b.prompt_token_ids) for b in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, item in enumerate(batch):
                n = len(item.prompt_token_ids)
                ids[row, width - n:] = torch.tensor(item.prompt_token_ids)
                mask[row, width - n:] = 1
            new = max(b.max_tokens for b in batch)
            # Every row runs to the batch's longest max_tokens (no EOS stop,
            # like ignore_eos); a row's own tokens beyond its max are not counted.
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
            output_tokens += sum(b.max_tokens for b in batch)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(i.prompt_token_ids) for i in items)
    return {"requests": len(items), "errors": 0, "wall_s": wall, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / wall,
            "total_tok_s": (prompt_tokens + output_tokens) / wall}


def make_workload(name: str, workdir: Path) -> Path:
    """Workloads not shipped in bench/workloads/, made with its generator.

    streams-32x128: 32 requests at t = 0, prompts as offline-64's (median 128
    tokens), each exactly 128 output tokens (an out-median far above the cap).
    """
    if name != "streams-32x128.jsonl":
        raise ValueError(f"unknown workload {name}")
    path = workdir / name
    text = subprocess.run([sys.executable, str(WORKLOADS / "generate.py"), "random", "-n", "32", "--out-median", "1000000",
                           "--out-max", "128"], check=True, capture_output=True, text=True).stdout
    path.write_text(text)
    return path


def computed_prompt_tokens(trace: Path) -> int:
    """Prompt tokens the worker actually computed (prefill work in the trace)."""
    return sum(json.loads(line)["prefill_tokens"] for line in trace.read_text().splitlines() if line)


CASES: dict[str, tuple[str, list[str]]] = {
    "continuous": ("offline-64.jsonl", []),
    "static-8": ("offline-64.jsonl", ["--policy", "static", "--max-num-seqs", "8"]),
    "sequential": ("offline-64.jsonl", ["--policy", "sequential"]),
    "continuous-8": ("offline-64.jsonl", ["--max-num-seqs", "8"]),
    "online": ("online-64.jsonl", []),
    "streams-32x128": ("streams-32x128.jsonl", []),
    "prefix-cache": ("prefix-64.jsonl", []),
    "no-prefix-cache": ("prefix-64.jsonl", ["--no-prefix-cache"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help=f"cases to run: {', '.join(CASES)}, hf-generate")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    wanted = args.only or [*CASES, "hf-generate"]
    results: dict[str, Any] = {}
    for name in wanted:
        if name == "hf-generate":
            results[name] = run_hf_baseline(load_workload(WORKLOADS / "offline-64.jsonl"))
        else:
            workload, flags = CASES[name]
            path = WORKLOADS / workload if (WORKLOADS / workload).exists() else make_workload(workload, args.workdir)
            results[name] = run_server_case(name, path, flags, args.workdir)
            results[name]["workload"] = workload
            results[name]["computed_prompt_tokens"] = computed_prompt_tokens(Path(results[name]["trace"]))
        print(json.dumps({k: v for k, v in results[name].items() if k != "server_stats"}), flush=True)
    (args.workdir / "results.json").write_text(json.dumps(results, indent=2))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    args.out.write_text(render(results, machine))
    print(f"wrote {args.out}")
    return 0 if all(r.get("errors", 0) == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
