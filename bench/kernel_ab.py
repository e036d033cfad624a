#!/usr/bin/env python3
"""Two or more builds of the CPU kernels side by side in one process.

    .venv/bin/python bench/kernel_ab.py --refs ccb0b7e WORK [--linears 1 8 64] [--kind bf16 int8]
        [--attention] [--step bf16 --batch 1 16 64] [--rounds 5]

On a shared machine the same build reads 10-15% apart from one process to
the next (memory placement, neighbours' load), which is more than most
kernel changes move. Here each ref's ``worker/kernels/cpu/csrc`` (a git ref, ``WORK``
for the working tree, or a folder) is compiled as its own operator
namespace (``torch.ops.jitney_ab0``, ``jitney_ab1``, ...: the sources'
``TORCH_LIBRARY(jitney_cpu`` renamed, symbols hidden) and the builds take
turns within one process, on the same tensors, each round starting from the
next build (a place in the order can cost: a script that timed the fused
gate_up of one build in the first and the third place, without this, read
it 8-13% slower in the first):

- ``--linears ROWS``: the default model's linear shapes, 30 distinct weights
  each and the head once, every weight called once per pass so that the
  weights stream from memory as in a step (``--kind``: bf16 ``linear``,
  int8 ``linear_int8``); median ms of a pass.
- ``--attention``: paged attention over 30 layers' caches with scattered
  blocks (decodes, a prefill chunk, a mixed step); median ms a layer.
- ``--step MODE --batch B``: the worker's decode step (``bench/decode_step.py``'s
  measure, 200 tokens of context) with the runner's CPU ops switched between
  the builds in turns; median model ms, and each round's. The layers run op
  by op there (``CausalLM.use_layer_stack`` off): the one-call stack calls
  the worker's own build.

Each table says whether the builds' outputs were bit-identical. Builds are
cached under ``$JITNEY_KERNEL_CACHE/ab`` by their sources.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from jitney.worker.kernels.cpu import ops as cpu_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(960, 576)] * 30 + [(576, 576)] * 30 + [(3072, 576)] * 30 + [(576, 1536)] * 30 + [(49152, 576)]
# The ops a step calls, switched together by --step.
STEP_OPS = ("linear", "linear_int8", "linear_int4", "paged_attention", "silu_mul", "rope_and_cache",
            "add_rms_norm", "rms_norm", "row_softmax_stats")


def sources(ref: str) -> dict[str, bytes]:
    """``worker/kernels/cpu/csrc``'s files at ``ref``: a git ref, ``WORK`` (the working tree) or a folder."""
    if ref == "WORK" or Path(ref).is_dir():
        folder = ROOT / "worker" / "kernels" / "cpu" / "csrc" if ref == "WORK" else Path(ref)
        return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.suffix in (".cpp", ".h")}
    # (revisions before the worker's sub-packages kept the sources in worker/csrc)
    for where in ("worker/kernels/cpu/csrc", "worker/csrc"):
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:{where}"],
                                capture_output=True, text=True)
        if listed.returncode == 0:
            return {name: subprocess.check_output(["git", "-C", str(ROOT), "show", f"{ref}:{where}/{name}"])
                    for name in listed.stdout.split() if name.endswith((".cpp", ".h"))}
    raise ValueError(f"{ref} has no CPU kernel sources (worker/kernels/cpu/csrc or worker/csrc)")


def renamed(files: dict[str, bytes], namespace: str) -> dict[str, bytes]:
    """The sources with their operator library ``jitney_cpu`` renamed to ``namespace``."""
    out = {}
    for name, text in files.items():
        for macro in (b"TORCH_LIBRARY(", b"TORCH_LIBRARY_FRAGMENT(", b"TORCH_LIBRARY_IMPL("):
            text = text.replace(macro + b"jitney_cpu", macro + namespace.encode())
        out[name] = text
    return out


def load_build(ref: str, namespace: str) -> Any:
    """Compile (or reuse) ``ref``'s kernels as ``torch.ops.<namespace>`` and return that namespace."""
    from torch.utils import cpp_extension

    files = renamed(sources(ref), namespace)
    flags = [*cpu_kernels.FLAGS, "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
    key = hashlib.sha256(b"".join(n.encode() + t for n, t in sorted(files.items())))
    key.update(" ".join(flags).encode() + torch.__version__.encode() + cpu_kernels._cpu_tag().encode())
    folder = cpu_kernels.cache_dir().parent / "ab" / f"{namespace}-{key.hexdigest()[:16]}"
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (src / name).write_bytes(text)
    cpp_extension.load(name=namespace, sources=[str(src / n) for n in sorted(files) if n.endswith(".cpp")],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(folder),
                       is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)


def turn_order(round_: int, n: int) -> list[int]:
    """The order of n calls in round ``round_``: from call round_ mod n, round."""
    return [*range(round_ % n, n), *range(round_ % n)]


def in_turns(calls: list[Callable[[], object]], rounds: int) -> list[list[float]]:
    """Each call's wall ms per round, the calls taking turns within every round, round r
    starting from call r mod n, so that each call takes each place in the order as often."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        for i in turn_order(r, len(calls)):
            started = time.perf_counter()
            calls[i]()
            times[i].append((time.perf_counter() - started) * 1000)
    return times


def same_bits(outputs: list[torch.Tensor]) -> str:
    return "yes" if all(torch.equal(outputs[0], o) for o in outputs[1:]) else "no"


def _bf16_call(ops: Any, packed: torch.Tensor, k: int, n: int, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = ops.linear(x, packed, None, k, n, False, False)
    return out


def _int8_call(ops: Any, packed: torch.Tensor, scale: torch.Tensor, k: int, n: int, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = ops.linear_int8(x, packed, scale, None, k, n, False, False)
    return out


def _pass(calls: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]], xs: dict[int, torch.Tensor]) -> None:
    for k, call in calls:
        call(xs[k])


def linears(builds: list[Any], refs: list[str], kind: str, rows_list: list[int], rounds: int) -> None:
    from jitney.worker.kernels.cpu.ops import quantize_int8

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n, k in SHAPES]
    # Every build reads the first build's packed tensors where its own packing is the same
    # bits: where the weights lie in memory moves a pass by up to ~40% on a shared machine.
    layers: list[list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]] = [[] for _ in builds]
    shared = True
    for w in weights:
        n, k = w.shape
        q, scale = quantize_int8(w) if kind == "int8" else (w.bfloat16(), torch.empty(0))
        first: torch.Tensor | None = None
        for ops, calls in zip(builds, layers):
            packed = ops.pack_int8_weight(q) if kind == "int8" else ops.pack_linear_weight(q)
            if first is None:
                first = packed
            elif torch.equal(packed, first):
                packed = first
            else:
                shared = False
            call = (functools.partial(_int8_call, ops, packed, scale, k, n) if kind == "int8"
                    else functools.partial(_bf16_call, ops, packed, k, n))
            calls.append((k, call))
    if not shared:
        print("(the builds pack the weights differently: each reads its own copy)")
    print(f"\n### {kind} linears: median ms of a pass over all weights ({rounds} rounds)\n")
    print("| rows | " + " | ".join(refs) + " | same bits |\n" + "|---" * (len(refs) + 2) + "|")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
        bits = same_bits([calls[2][1](xs[576]) for calls in layers])
        passes: list[Callable[[], object]] = [functools.partial(_pass, calls, xs) for calls in layers]
        times = in_turns(passes, rounds + 1)
        cells = " | ".join(f"{statistics.median(t[1:]):.2f}" for t in times)
        print(f"| {rows} | {cells} | {bits} |", flush=True)


def attention(builds: list[Any], refs: list[str], rounds: int) -> None:
    from bench.cpu_attention import BLOCK as block, HEAD_DIM as head_dim, HEADS as heads, KV_HEADS as kv_heads
    from bench.cpu_attention import case_metadata
    from jitney.worker.attention.backend import to_kernel_layout

    layers = 30
    gen = torch.Generator().manual_seed(0)
    caches = [to_kernel_layout(torch.randn(2000, block, kv_heads, head_dim, generator=gen).bfloat16(),
                               torch.randn(2000, block, kv_heads, head_dim, generator=gen).bfloat16())
              for _ in range(layers)]
    order = torch.randperm(2000, generator=gen).tolist()
    cases = {"decode 64 x 200": ([1] * 64, [200] * 64), "decode 64 x 400": ([1] * 64, [400] * 64),
             "decode 8 x 300": ([1] * 8, [300] * 8), "prefill 512": ([512], [512]),
             "mixed: 4 x 128-token chunks + 32 decodes": ([128] * 4 + [1] * 32, [128] * 4 + [300] * 32)}
    print(f"\n### paged attention: median ms a layer, {layers} layers' scattered caches ({rounds} rounds)\n")
    print("| case | " + " | ".join(refs) + " | same bits |\n" + "|---" * (len(refs) + 2) + "|")
    for name, (query_lens, seq_lens) in cases.items():
        meta = case_metadata(query_lens, seq_lens, order)
        query = torch.randn(sum(query_lens), heads, head_dim, generator=gen).bfloat16()

        def call(ops: Any, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            return ops.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, head_dim ** -0.5)

        def layer_pass(ops: Any) -> None:
            for k_cache, v_cache in caches:
                call(ops, k_cache, v_cache)

        bits = same_bits([call(ops, *caches[0]) for ops in builds])
        times = in_turns([functools.partial(layer_pass, ops) for ops in builds], rounds)
        cells = " | ".join(f"{statistics.median(t) / layers:.3f}" for t in times)
        print(f"| {name} | {cells} | {bits} |", flush=True)


def step(builds: list[Any], refs: list[str], mode: str, batches: list[int], rounds: int) -> None:
    from bench.decode_step import make_runner, measure

    config: dict[str, Any] = {} if mode == "bf16" else {"quantization": mode}
    runner = make_runner("auto", **config)
    # Op by op: the one-call layer stack is the worker's own build's (csrc/layer_stack.cpp calls
    # its kernels directly), so switching the ops' namespace would not switch what it runs.
    runner.model.use_layer_stack = False
    namespace = torch.ops.jitney_cpu
    layer_ops: Any = runner.model.ops

    def use(ops: Any) -> None:
        for name in STEP_OPS:
            setattr(namespace, name, getattr(ops, name))
        if hasattr(layer_ops, "_rms_norm"):   # InvariantCpuLayerOps keeps its ops' overloads
            layer_ops._rms_norm, layer_ops._add_rms_norm = ops.rms_norm.default, ops.add_rms_norm.default
            layer_ops._rope_and_cache, layer_ops._silu_mul = ops.rope_and_cache.default, ops.silu_mul.default

    print(f"\n### decode step ({mode}, 200 tokens of context, the layers op by op): model ms, median of {rounds} "
          "rounds (each round)\n")
    print("| batch | " + " | ".join(refs) + " |\n" + "|---" * (len(refs) + 1) + "|")
    try:
        for batch in batches:
            times: list[list[float]] = [[] for _ in builds]
            for r in range(rounds):
                for i in turn_order(r, len(builds)):
                    use(builds[i])
                    times[i].append(measure(runner, batch, 200, 10)[0] * 1000)
            cells = " | ".join(f"{statistics.median(t):.2f} ({', '.join(f'{v:.1f}' for v in t)})" for t in times)
            print(f"| {batch} | {cells} |", flush=True)
    finally:
        for name in STEP_OPS:   # the runner's own build again
            if hasattr(namespace, name):
                delattr(namespace, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refs", nargs="+", required=True, help="git refs, WORK (the working tree) or folders")
    parser.add_argument("--linears", nargs="*", type=int, default=None, metavar="ROWS")
    parser.add_argument("--kind", nargs="+", choices=["bf16", "int8"], default=["bf16"])
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--step", nargs="+", choices=["bf16", "int8", "int4"], default=[])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    cpu_kernels.load()
    builds = [load_build(ref, f"jitney_ab{i}") for i, ref in enumerate(args.refs)]
    print(f"builds: {', '.join(args.refs)}; {torch.get_num_threads()} threads")
    if args.linears:
        for kind in args.kind:
            linears(builds, args.refs, kind, args.linears, args.rounds)
    if args.attention:
        attention(builds, args.refs, args.rounds)
    for mode in args.step:
        step(builds, args.refs, mode, args.batch, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
