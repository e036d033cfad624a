"""The model families on this CPU, side by side in one run: offline-64 wall and batch-1 TPOT.

    python bench/families.py [--cases llama-0.6b,qwen3-0.6b,...] [--json FILE]

Each case is a random-weight bf16 checkpoint with a real model's shapes (layer counts
cut where noted, hidden and expert sizes kept), served by a fresh `jitney serve`
(batch-invariant CPU kernels, the default) and replayed by `jitney bench`: the
whole offline-64 workload (greedy, ignore_eos), then its first 8 requests one at a
time (batch-1 TPOT).

    llama-0.6b    Llama with Qwen3-0.6B's dims (hidden 1024, 28 layers, 16 q / 8 KV heads
                  of 128, MLP 3072, vocab 151936, tied): the same matmuls without q/k norms
    qwen3-0.6b    Qwen3-0.6B's shape
    llama-1b-gemma-dims  Llama with Gemma-3-1B's dims (as below, tied, no windows): the same
                  matmuls without Gemma's extra norms, GELU, soft caps and windows
    gemma3-1b     Gemma-3-1B's shape (hidden 1152, 26 layers, 4 q / 1 KV heads of 256, MLP 6912,
                  vocab 262144, windows of 512 in five layers of six)
    qwen3-moe-4l  Qwen3-30B-A3B cut to 4 of its 48 layers (hidden 2048, 32 q / 4 KV heads of
                  128, 128 experts of 768, 8 per token, vocab 151936)
    llama-3.2-1b  Llama-3.2-1B's shape, whole (hidden 2048, 16 layers, 32 q / 8 KV heads of 64,
                  MLP 8192, vocab 128256, tied); bench/real_shapes.py's
    qwen3-4b      Qwen3-4B's shape, whole (hidden 2560, 36 layers, 32 q / 8 KV heads of 128,
                  MLP 9728, vocab 151936, tied); bench/real_shapes.py's

Each dense pair's ratio (qwen3-0.6b / llama-0.6b, gemma3-1b / llama-1b-gemma-dims) is the per-FLOP and per-weight-byte cost of Qwen3's family
against Llama's (the same work but the norms); the MoE case reports its batch-1
step time against its routed-weights floor: the bytes of the attention, the
router and 8 experts per layer, plus the head, at the read rate measured here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import ROOT, running_server  # noqa: E402

WORKLOAD = ROOT / "bench" / "workloads" / "offline-64.jsonl"
QWEN3_06B: dict[str, Any] = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
                             "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                             "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
QWEN3_MOE: dict[str, Any] = {"hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32,
                             "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                             "norm_topk_prob": True, "vocab_size": 151936, "tie_word_embeddings": False,
                             "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "bos_token_id": 1,
                             "eos_token_id": 2}


GEMMA3_1B: dict[str, Any] = {"hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
                             "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                             "vocab_size": 262144, "sliding_window": 512, "query_pre_attn_scalar": 256,
                             "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "bos_token_id": 1,
                             "eos_token_id": 2, "pad_token_id": 0}

# bench/real_shapes.py's two real-size dense shapes, whole (rope scaling left out: it changes no cost)
LLAMA32_1B: dict[str, Any] = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                              "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                              "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
QWEN3_4B: dict[str, Any] = {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
                            "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                            "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}


def make_model(case: str, path: Path) -> Path:
    import torch
    import transformers

    from bench.gpu_sections.checkpoints import make_fast_tokenizer

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if case == "llama-0.6b":
        config: Any = transformers.LlamaConfig(**QWEN3_06B, rope_parameters=rope)
        cls: Any = transformers.LlamaForCausalLM
    elif case == "llama-1b-gemma-dims":
        dims = {k: v for k, v in GEMMA3_1B.items() if k not in ("sliding_window", "query_pre_attn_scalar")}
        config = transformers.LlamaConfig(**dims, tie_word_embeddings=True, rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    elif case == "gemma3-1b":
        config = transformers.Gemma3TextConfig(**GEMMA3_1B, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
        cls = transformers.Gemma3ForCausalLM
    elif case == "qwen3-0.6b":
        config = transformers.Qwen3Config(**QWEN3_06B, rope_parameters=rope)
        cls = transformers.Qwen3ForCausalLM
    elif case == "llama-3.2-1b":
        config = transformers.LlamaConfig(**LLAMA32_1B, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        cls = transformers.LlamaForCausalLM
    elif case == "qwen3-4b":
        config = transformers.Qwen3Config(**QWEN3_4B, rope_parameters=rope)
        cls = transformers.Qwen3ForCausalLM
    elif case == "qwen3-moe-4l":
        config = transformers.Qwen3MoeConfig(**QWEN3_MOE, rope_parameters=rope)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown case {case!r}")
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():   # random weights, without transformers' slow per-module init
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.02)
    model.save_pretrained(str(path), safe_serialization=True)
    make_fast_tokenizer(path, config.vocab_size)
    return path


def bench(model: Path, scratch: Path, workload: Path, concurrency: int | None) -> dict[str, Any]:
    out = scratch / "summary.json"
    cmd = [sys.executable, "-m", "jitney.cli", "bench", "--workload", str(workload), "--json", str(out),
           "--no-progress"]
    with running_server(["--model", str(model), "--no-weights-cache", "--dtype", "bfloat16"], scratch,
                        startup_timeout=900) as server:
        subprocess.run([*cmd[:4], "--target", server.target, *cmd[4:],
                        *(["--max-concurrency", str(concurrency)] if concurrency else [])], check=True, cwd=ROOT)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def read_rate_gb_s() -> float:
    """Bytes per second a 2-thread torch sum reads from a 1 GB tensor (best of 5)."""
    import torch

    big = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - started)
    return big.numel() * 4 / best / 1e9


def moe_routed_bytes() -> int:
    c = QWEN3_MOE
    h, d = c["hidden_size"], c["head_dim"]
    attention = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"] + c["num_experts"] * h
    return 2 * (c["num_hidden_layers"] * (attention + experts) + c["vocab_size"] * h)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="llama-0.6b,qwen3-0.6b,qwen3-moe-4l")
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    results: dict[str, Any] = {"read_rate_gb_s": read_rate_gb_s()}
    with tempfile.TemporaryDirectory(prefix="jitney-families-") as tmp:
        root = Path(tmp)
        first8 = root / "first8.jsonl"
        first8.write_text("".join(WORKLOAD.read_text().splitlines(keepends=True)[:8]))
        for case in ns.cases.split(","):
            model = make_model(case, root / case)
            offline = bench(model, root, WORKLOAD, None)
            single = bench(model, root, first8, 1)
            results[case] = {"offline64_wall_s": offline["wall_s"], "offline64_output_tok_s": offline["output_tok_s"],
                             "batch1_tpot_p50_ms": single["tpot_s"]["p50"] * 1e3, "errors": offline["errors"]}
            print(case, json.dumps(results[case]), flush=True)
            subprocess.run(["rm", "-rf", str(root / case)], check=True)
    if "qwen3-moe-4l" in results:
        floor_ms = moe_routed_bytes() / (results["read_rate_gb_s"] * 1e9) * 1e3
        results["qwen3-moe-4l"]["routed_floor_ms"] = floor_ms
        results["qwen3-moe-4l"]["tpot_over_floor"] = results["qwen3-moe-4l"]["batch1_tpot_p50_ms"] / floor_ms
    if "llama-0.6b" in results and "qwen3-0.6b" in results:
        results["qwen3_over_llama_wall"] = results["qwen3-0.6b"]["offline64_wall_s"] / results["llama-0.6b"]["offline64_wall_s"]
    if "llama-1b-gemma-dims" in results and "gemma3-1b" in results:
        results["gemma3_over_llama_wall"] = (results["gemma3-1b"]["offline64_wall_s"]
                                             / results["llama-1b-gemma-dims"]["offline64_wall_s"])
    print(json.dumps(results, indent=1))
    if ns.json:
        ns.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
