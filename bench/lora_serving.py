#!/usr/bin/env python3
"""What LoRA adapters cost a served model: offline-64 base-only, with adapters
resident but unused, and spread over four adapters, side by side in one run.

    .venv/bin/python bench/lora_serving.py [--repeat 2] [--rank 16] [--limit N] [--json FILE]

Cases, each a fresh `jitney serve` on the default model replaying
bench/workloads/offline-64.jsonl with `jitney bench` (greedy, ignore_eos,
exactly max_tokens per request; any error fails the run):

    base     no LoRA flags
    loaded   --max-loras 4 --lora-modules a0..a3; one request for a0 first (its
             slot filled), then the replay, every request on the base model
    mix      the same server; request i of the replay names adapter a(i mod 4)

The four adapters are random (seeded), rank ``--rank`` on all seven modules
(q/k/v/o, gate/up/down) of every layer, written as PEFT saves them. The cases
run in turns (base loaded mix base loaded mix ...) so the machine's drift falls
on all of them; the table gives every run, the medians and the issue's ratios:
loaded / base output tok/s (target >= 0.97) and mix / base (>= 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.server_harness import running_server  # noqa: E402

WORKLOAD = ROOT / "bench" / "workloads" / "offline-64.jsonl"
ADAPTERS = 4


def default_model_modules() -> tuple[dict[str, tuple[int, int]], int]:
    """The default model's linears an adapter may target, PEFT name -> (in, out), and its
    number of layers, read from its config (no weights loaded)."""
    from jitney.common.model_files import resolve_model
    from jitney.worker.loading.loader import load_hf_config, model_config_from_hf

    cfg = model_config_from_hf(load_hf_config(resolve_model(None)))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    modules = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
               "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return modules, cfg.num_layers


def write_adapter(path: Path, rank: int, seed: int, modules: dict[str, tuple[int, int]], layers: int) -> Path:
    """A random rank-``rank`` PEFT adapter on every one of ``modules`` in each of ``layers``."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module, (n_in, n_out) in modules.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
              "bias": "none", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def workload_with_adapters(source: Path, out: Path, names: list[str], limit: int | None) -> Path:
    """``source``'s lines, the first ``limit``, with request i naming ``names[i % len(names)]``
    (no names: unchanged)."""
    lines = [line for line in source.read_text().splitlines() if line.strip()][:limit]
    rows = [json.loads(line) for line in lines]
    for i, row in enumerate(rows):
        if names:
            row["lora_adapter"] = names[i % len(names)]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def bench(target: str, workload: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "jitney.cli", "bench", "--target", target, "--workload", str(workload),
           "--json", str(out), "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads(out.read_text())
    if summary["errors"]:
        raise SystemExit(f"{workload.name}: {summary['errors']} requests failed")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--limit", type=int, help="the first N requests of the workload (a short run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "loaded": [], "mix": []}
    with tempfile.TemporaryDirectory(prefix="jitney-lora-bench-") as tmp:
        work = Path(tmp)
        names = [f"a{i}" for i in range(ADAPTERS)]
        modules, layers = default_model_modules()
        folders = [write_adapter(work / name, args.rank, i, modules, layers) for i, name in enumerate(names)]
        lora_flags = ["--max-loras", str(ADAPTERS), "--max-lora-rank", str(args.rank), "--lora-modules",
                      *[f"{n}={f}" for n, f in zip(names, folders)]]
        plain = workload_with_adapters(WORKLOAD, work / "base.jsonl", [], args.limit)
        spread = workload_with_adapters(WORKLOAD, work / "mix.jsonl", names, args.limit)
        warm = workload_with_adapters(WORKLOAD, work / "warm.jsonl", names[:1], 1)
        for turn in range(args.repeat):
            for case in ("base", "lora", "mix"):
                (work / f"{case}-{turn}").mkdir()
            with running_server([], work / f"base-{turn}", startup_timeout=300) as server:
                runs["base"].append(bench(server.target, plain, work / "base.json"))
            with running_server(lora_flags, work / f"lora-{turn}", startup_timeout=300) as server:
                bench(server.target, warm, work / "warm.json")
                runs["loaded"].append(bench(server.target, plain, work / "loaded.json"))
            with running_server(lora_flags, work / f"mix-{turn}", startup_timeout=300) as server:
                runs["mix"].append(bench(server.target, spread, work / "mix.json"))
            print(f"turn {turn}: " + ", ".join(f"{case} {r[-1]['output_tok_s']:.1f} tok/s"
                                              for case, r in runs.items()), flush=True)
    median = {case: statistics.median(r["output_tok_s"] for r in rs) for case, rs in runs.items()}
    result = {
        "runs": {case: [{k: r[k] for k in ("wall_s", "output_tok_s", "ttft_s", "tpot_s")} for r in rs]
                 for case, rs in runs.items()},
        "median_output_tok_s": median,
        "loaded_over_base": median["loaded"] / median["base"],
        "mix_over_base": median["mix"] / median["base"],
    }
    print("| case | output tok/s per run | median | / base |")
    print("|---|---|---|---|")
    for case, rs in runs.items():
        each = ", ".join(f"{r['output_tok_s']:.1f}" for r in rs)
        print(f"| {case} | {each} | {median[case]:.1f} | {median[case] / median['base']:.3f} |")
    print(f"loaded / base {result['loaded_over_base']:.3f} (target >= 0.97); "
          f"mix / base {result['mix_over_base']:.3f} (target >= 0.8)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
