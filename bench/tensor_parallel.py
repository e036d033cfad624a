"""What tensor parallelism costs on this CPU: offline-64 with N=2 ranks vs N=1.

    python bench/tensor_parallel.py [--workload bench/workloads/offline-64.jsonl] [--json FILE]

The default model (SmolLM2-135M: 9 heads, 3 KV heads) does not split two
ways, so this runs a random-weight Llama of its size and vocabulary with 8
heads of 72 and 4 KV heads (hidden 576, 30 layers, MLP 1536, tied). Each
case is `jitney serve` replayed by `jitney bench` (greedy, ignore_eos):

    n1-t1   --tensor-parallel-size 1 --threads 1    one core of compute
    n1-t2   --tensor-parallel-size 1 --threads 2    both cores, one process
    n2-t1   --tensor-parallel-size 2 --threads 1    one core per rank

Nobody expects TP to speed up a 2-core CPU (the scheduler shares the cores);
n2-t1 vs n1-t2 is the price of the relay and the 2 all-reduces per layer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import ROOT, running_server  # noqa: E402

SHAPE: dict[str, Any] = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
         "intermediate_size": 1536, "tie_word_embeddings": True, "vocab_size": 49152,
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0}
CASES = {"n1-t1": ["--tensor-parallel-size", "1", "--threads", "1"],
         "n1-t2": ["--tensor-parallel-size", "1", "--threads", "2"],
         "n2-t1": ["--tensor-parallel-size", "2", "--threads", "1"]}


def make_model(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu_sections.checkpoints import make_fast_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    LlamaForCausalLM(config).eval().save_pretrained(str(path), safe_serialization=True)
    make_fast_tokenizer(path, SHAPE["vocab_size"])
    return path


def run_case(model: Path, flags: list[str], workload: Path, scratch: Path) -> dict[str, Any]:
    out = scratch / "summary.json"
    args = ["--model", str(model), "--no-weights-cache", *flags]
    with running_server(args, scratch, startup_timeout=600) as server:
        subprocess.run([sys.executable, "-m", "jitney.cli", "bench", "--target", server.target,
                        "--workload", str(workload), "--json", str(out), "--no-progress"], check=True, cwd=ROOT)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=ROOT / "bench" / "workloads" / "offline-64.jsonl")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="jitney-tp-") as tmp:
        model = make_model(Path(tmp) / "model")
        for name in ns.cases.split(","):
            results[name] = run_case(model, CASES[name], ns.workload, Path(tmp))
            print(name, json.dumps(results[name]), flush=True)
    if ns.json:
        ns.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
