#!/usr/bin/env python3
"""The one-call C++ layer stack against op by op, per model family, in one run.

    .venv/bin/python bench/layer_stack_families.py [--families llama,gemma3,...] [--dtype bfloat16]
        [--batch 1 8] [--context 100] [--reps 10] [--rounds 3]

Each family is a random-weight checkpoint of one small shared shape (hidden 256,
8 layers, 4 q / 2 KV heads of 64, MLP 768; the MoE families 8 experts of 256, 2
per token; Gemma's sliding layers windows of 32 keys), so that a step's Python
around the ops, which the stack removes, is a visible share of it. One runner per
family; ``CausalLM.use_layer_stack`` flips between stack and op by op in turns
over ``--rounds`` rounds on the same runner (bench/decode_step.py's ``measure``:
median model time of ``--reps`` decode steps of ``--batch`` sequences of
``--context`` tokens); the table gives the median of the rounds' medians and
their ratio, and the ratio of the best rounds (the least disturbed on a shared
machine). There the ratios are the figures to read, not the milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.decode_step import make_runner, measure  # noqa: E402
from tests.support.tiny_models import EOS_TOKEN_ID, make_tokenizer  # noqa: E402

VOCAB = 1024
SHAPE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
                             pad_token_id=0)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)
SLIDING = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 2


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, use_sliding_window=False))


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**SHAPE, sliding_window=32, layer_types=SLIDING, query_pre_attn_scalar=64,
                                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0))


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, sliding_window=32, layer_types=SLIDING,
                                              query_pre_attn_scalar=64, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}))


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    shape = {**SHAPE, "intermediate_size": 256}
    return MixtralForCausalLM(MixtralConfig(**shape, **MOE, num_local_experts=8, sliding_window=None))


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, **MOE, num_experts=8, moe_intermediate_size=256,
                                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[3],
                                               use_sliding_window=False))
    with torch.no_grad():   # transformers starts the router at zeros: every expert would tie
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and getattr(gate, "weight", None) is not None and gate.weight.shape[0] == 8:
                gate.weight.normal_(0, 0.5)
    return model


FAMILIES: dict[str, Callable[[], Any]] = {"llama": _llama, "qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3,
                                          "mixtral": _mixtral, "qwen3-moe": _qwen3_moe}


def make_model(name: str, path: Path) -> Path:
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path, VOCAB)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; decode steps of {args.context}-token contexts, model time, "
          f"median (and best) of {args.rounds} rounds' medians of {args.reps}")
    print("| family | dtype | batch | op by op ms | stack ms | op by op / stack | best: op by op / stack |\n"
          "|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name in args.families.split(","):
            path = make_model(name, Path(root) / name)
            for dtype in args.dtype:
                runner = make_runner(dtype, model=str(path), max_seqs=64)
                assert runner.model.layer_stack(runner.cache) is not None, f"{name}: no stack"
                for batch in args.batch:
                    got: dict[bool, list[float]] = {True: [], False: []}
                    for _ in range(args.rounds):
                        for stack in (False, True):
                            runner.model.use_layer_stack = stack
                            got[stack].append(measure(runner, batch, args.context, args.reps)[0])
                    runner.model.use_layer_stack = True
                    plain, stacked = statistics.median(got[False]), statistics.median(got[True])
                    best = min(got[False]) / min(got[True])
                    print(f"| {name} | {dtype} | {batch} | {plain * 1000:.2f} | {stacked * 1000:.2f} | "
                          f"{plain / stacked:.2f} | {best:.2f} |", flush=True)
                del runner
    return 0


if __name__ == "__main__":
    sys.exit(main())
