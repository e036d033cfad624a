#!/usr/bin/env python3
"""CPU paged attention: the batch-invariant kernel, in each form this CPU has, against gather + SDPA.

    .venv/bin/python bench/cpu_attention.py [--reps 10] [--layers 30 --scattered] [--threads 1] [--no-sdpa]
        [--dtype bfloat16|float32]

The default model's attention shape (9 query heads, 3 KV heads, head_dim 64,
16-token blocks, bf16 or ``--dtype float32``) on a 512-token prefill and on decode steps of 1 and
64 sequences. The kernel runs in every form the CPU has (amx, avx512bf16, avx512, avx2, portable;
the server runs attention_kernel()'s); the backends attend the same queries over the same paged
cache; milliseconds per call (one layer), mean of ``--reps`` after a warm-up.

``--layers N``: N distinct caches, one call on each per rep (as a step's
layers do), so that they stream from memory instead of sitting in the
caches of the CPU; ``--scattered``: each sequence's blocks at random places
in the cache (as after the server has run a while) instead of in a row.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.worker.attention.backend import (  # noqa: E402
    AttentionMetadata, TorchPagedAttention, to_kernel_layout)
from jitney.worker.kernels.cpu import ops as cpu_kernels  # noqa: E402

FORMS = ["avx512", "avx2", "avx512bf16", "amx", "portable"]  # the kernel's forms (portable: the scalar loops)


def usable(form: str) -> bool:
    """Whether this CPU (and build) runs ``form``: set_attention_kernel refuses one it lacks."""
    try:
        cpu_kernels.set_attention_kernel(form)
    except RuntimeError:
        return False
    finally:
        cpu_kernels.set_attention_kernel("auto")
    return True

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = {"prefill 512": ([512], [512]), "prefill 512 at 3000": ([512], [3000]), "decode 1 x 200": ([1], [200]),
         "decode 64 x 200": ([1] * 64, [200] * 64), "decode 64 x 400": ([1] * 64, [400] * 64)}


def case_metadata(query_lens: list[int], seq_lens: list[int], order: list[int]) -> AttentionMetadata:
    """A case's metadata, its sequences' blocks taken from ``order`` in turn (consecutive or scattered)."""
    tables, first = [], 0
    for length in seq_lens:
        tables.append(order[first:first + math.ceil(length / BLOCK)])
        first += len(tables[-1])
    return AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                   block_size=BLOCK, device=torch.device("cpu"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=1, help="distinct caches, each called once per rep")
    parser.add_argument("--scattered", action="store_true", help="sequences' blocks at random places")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-sdpa", action="store_true", help="the invariant kernel only")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    caches = [(torch.randn(2000, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
               torch.randn(2000, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for _ in range(args.layers)]
    order = torch.randperm(2000, generator=gen).tolist() if args.scattered else list(range(2000))

    # The same values in each backend's own cache layout.
    kernel_caches = [to_kernel_layout(k_cache, v_cache) for k_cache, v_cache in caches]

    def per_call(attend: Callable[[torch.Tensor, torch.Tensor], object], own: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> float:
        for k_cache, v_cache in own:
            attend(k_cache, v_cache)
        started = time.perf_counter()
        for _ in range(args.reps):
            for k_cache, v_cache in own:
                attend(k_cache, v_cache)
        return (time.perf_counter() - started) / (len(own) * args.reps) * 1000

    have = cpu_kernels.attention_kernel()
    bf16_only = ("amx", "avx512bf16")
    forms = [form for form in FORMS if usable(form) and (dtype == torch.bfloat16 or form not in bf16_only)]
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.layers} distinct caches, "
          f"{'scattered' if args.scattered else 'consecutive'} blocks; the server's form: {have}")
    print("| case | " + " | ".join(f"kernel ({form}) ms" for form in forms) + " | gather + SDPA ms |")
    print("|---|" + "---|" * (len(forms) + 1))
    for name, (query_lens, seq_lens) in CASES.items():
        meta = case_metadata(query_lens, seq_lens, order)
        query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
        cells = []
        for form in forms:
            def call(k: torch.Tensor, v: torch.Tensor, form: str = form) -> torch.Tensor:
                return cpu_kernels.paged_attention(query, k, v, meta.block_tables, meta.seq_lens,
                                                   meta.query_start_loc, HEAD_DIM ** -0.5, form)
            cells.append(per_call(call, kernel_caches))
        if args.no_sdpa:
            sdpa = "–"
        else:
            torch_meta = TorchPagedAttention().prepare(meta)
            sdpa = f"{per_call(lambda k, v: TorchPagedAttention().attend(query, k, v, torch_meta, HEAD_DIM ** -0.5), caches):.2f}"
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {sdpa} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
