#!/usr/bin/env python3
"""The project's own GPU benchmark: one script, random-weight checkpoints, under a time budget.

    python bench/gpu.py [--device cuda] [--shape 1b --shape 135m:decode] [--tokenizer DIR]
                        [--workload-dir DIR] [--limit N] [--budget-s 280] [--out FILE] [--json FILE]

On a GPU machine without network access (../shared/gpu/README.md), with the
kit of ../shared/gpu/prepare.sh, from the repository root:

    python bench/gpu.py --tokenizer .device-kit/tok --workload-dir .device-kit/bench \\
        --out $OUT/gpu.md --json $OUT/gpu.json --workdir $OUT/gpu

(jitney need not be installed there: with only the repository on
PYTHONPATH, ``ensure_jitney_importable`` links the ``jitney.*`` layout.)

For each ``--shape NAME[:SECTIONS]`` (sections: offline, decode, prefill, hf,
invariance; all when none are named), in that order:

* a random-weight Llama checkpoint of that shape is made on the device
  (bf16 on CUDA, fp32 on CPU) with the tokenizer files next to it;
* offline: ``jitney serve --model DIR --device D --dtype T --trace FILE``
  replays offline-64 with ``jitney bench`` (greedy, ignore_eos, exactly
  max_tokens): default flags on a fresh Triton cache, again warm (the same
  cache), and ``--policy static --max-num-seqs 8``. Recorded: wall, output
  tok/s, TTFT p50, start-up time and the server's start-up lines, and from
  the step trace (every step after Ready) the number of steps, the longest
  ``dur``, the first two ``dur`` and the steps over 50 ms;
* decode: the worker's ``ModelRunner`` driven with engine plans: B sequences
  are prefilled with ``--context`` tokens, then decode steps of all B are
  timed: wall time around ``runner.execute(plan)`` (it returns host
  results, so it has synced), median and best of ``--reps`` after 3
  warm-ups; and the captured decode graph alone
  (``runner.graphs.replay_seconds(B)``, CUDA events) where it exists;
* prefill: one step of a single ``--prefill-tokens`` chunk (a fresh
  sequence each time, freed after), the same wall time around
  ``execute()``: the first (cold) one, then, after one more warm-up, median
  and best of ``--reps``;
* hf: transformers' continuous batching (``init_continuous_batching``) on
  the same card and the same requests: greedy, no EOS, each request its own
  ``max_new_tokens``; wall from the first ``add_request`` to the last result
  (its warm-up, i.e. graph capture, is not timed, like Jitney's start-up);
* invariance (``--invariance`` runs only this, on 1b and 135m; on CUDA what
  decides whether ``--batch-invariant`` becomes the default: on when it costs
  <= 10%): two ``ModelRunner``s, ``batch_invariant=False`` and ``True``
  (the device's default seats and a 2048-token step). On each, with
  ``tests/support/invariance_driver.py``: ``--invariance-prompts`` prompts (token
  ids of lengths 1 .. ``--invariance-longest``), greedy and seeded (T 0.8,
  top_p 0.9, seed 1000 + prompt), run alone as the reference, then
  ``--invariance-requests`` requests over them, shuffled, arriving in
  waves, continuously batched at each ``--invariance-budgets`` step budget
  (chunked prefill, prefix-cache hits, two preemptions): per (shape,
  setting, budget) the requests whose token ids / log-probs are not
  bit-identical to their alone run. The cost, on the same two runners: the
  decode step at batch 1 and 64 and one eager step of the largest
  ``--prefill-tokens``, off and on alternating for ``--invariance-rounds``;
  then, for the ``--invariance-offline-shapes`` (1b), offline-64 on
  ``jitney serve --no-batch-invariant`` / ``--batch-invariant`` (the
  offline case's measure), alternating, and the ratio of the median walls.

Everything runs under ``--budget-s`` of wall clock: a case that would start
with too little time left is skipped, and the report says so.

``--device cpu --limit 4`` (the ``tiny`` shape) runs the same plumbing in
``make test`` (tests/bench/test_bench_gpu.py). On CPU there is no Triton cache to
warm (the attention backend is torch's), so the fresh/warm pair is one case,
"default", and the servers get ``--num-blocks 1024`` instead of the 2 GiB
default cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # Last, not first: for ``bench.*``; an installed jitney (a wheel on PYTHONPATH) must not be
    # shadowed by the checkout's bare jitney/ folder.
    sys.path.append(str(ROOT))

# Each section's measurements live in bench/gpu_sections/ (its __init__ says which where).
from bench.gpu_sections.checkpoints import SHAPES, make_checkpoint, tokenizer_dir  # noqa: E402
from bench.gpu_sections.hf import section_hf  # noqa: E402
from bench.gpu_sections.invariance import section_invariance  # noqa: E402
from bench.gpu_sections.offline import section_offline  # noqa: E402
from bench.gpu_sections.plumbing import Budget, Run, ensure_jitney_importable, is_cuda, log, machine_meta  # noqa: E402
from bench.gpu_sections.report import render  # noqa: E402
from bench.gpu_sections.steps import section_steps  # noqa: E402

SECTIONS = ("offline", "decode", "prefill", "hf", "invariance")


def parse_shape_spec(spec: str) -> tuple[str, list[str]]:
    """``NAME[:SECTION,SECTION]`` -> (name, sections)."""
    name, _, rest = spec.partition(":")
    if name not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown shape {name!r} (one of {', '.join(SHAPES)})")
    sections = [s for s in rest.split(",") if s] or list(SECTIONS)
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown section {bad[0]!r} (one of {', '.join(SECTIONS)})")
    return name, [s for s in SECTIONS if s in sections]


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shape", action="append", type=parse_shape_spec, default=None, metavar="NAME[:SECTIONS]",
                   help="shape (1b, 135m, tiny) and its sections (offline,decode,prefill,hf,invariance; default "
                        "all); repeatable (default: 1b, then 135m:decode on CUDA; tiny on CPU)")
    p.add_argument("--invariance", action="store_true",
                   help="the invariance section (--batch-invariant off/on: differing requests and the cost); "
                        "alone it runs 1b:invariance and 135m:invariance on CUDA (tiny:invariance on CPU); "
                        "with --shape, it is added to each named shape's sections")
    p.add_argument("--invariance-prompts", type=int, default=None, metavar="N",
                   help="prompts run alone, greedy and seeded (default 10 on CUDA, 4 on CPU)")
    p.add_argument("--invariance-longest", type=int, default=None, metavar="TOKENS",
                   help="longest prompt; lengths spread from 1 (default 1000 on CUDA, 40 on CPU)")
    p.add_argument("--invariance-requests", type=int, default=None, metavar="N",
                   help="batched requests over the prompts (default 180 on CUDA, 24 on CPU)")
    p.add_argument("--invariance-tokens", type=int, default=None, metavar="N",
                   help="output tokens per request (default 32 on CUDA, 6 on CPU)")
    p.add_argument("--invariance-budgets", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="step budgets of the batched runs (default 2048 256 on CUDA, 2048 16 on CPU)")
    p.add_argument("--invariance-rounds", type=int, default=None, metavar="N",
                   help="off/on rounds of the step timings and of the offline-64 servers (default 2 on CUDA, 1 on CPU)")
    p.add_argument("--invariance-offline-shapes", nargs="*", default=["1b", "tiny"], metavar="SHAPE",
                   help="shapes whose invariance section also replays offline-64 off/on (default 1b tiny)")
    p.add_argument("--invariance-reserve-s", type=float, default=None,
                   help="skip an invariance runner with less than this left (default 30 on CUDA, 5 on CPU)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder to copy into each checkpoint (default: a byte-level BPE of 49152 "
                        "tokens made here, like tests/support/tiny_models.py's; on the GPU machine .device-kit/tok)")
    p.add_argument("--workload-dir", default=str(ROOT / "bench" / "workloads"), metavar="DIR",
                   help="folder of offline-64.jsonl (default: bench/workloads)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64],
                   help="decode batch sizes (default 1 16 64; with --limit N, capped at N/2)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence before the timed decode steps "
                                                             "(default 128 on CUDA, 32 on CPU)")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=None,
                   help="tokens of each measured prefill step (default 512 2048 on CUDA, 64 on CPU)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: torch.profiler tables of a decode step (batch 1, 64) and a 2048-token prefill, "
                        "written next to --out")
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile of execute() over decode steps (batch 1, the largest) and two prefill steps, "
                        "by own and cumulative time, written next to --out as host-profile-SHAPE.txt")
    p.add_argument("--reps", type=int, default=None, help="timed reps per measurement (default 20 on CUDA, 5 on CPU)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    p.add_argument("--offline-cases", nargs="+", choices=["fresh", "warm", "static"], default=["fresh", "warm", "static"],
                   help="offline-64 servers to run (default all: default flags on a fresh Triton cache, again warm, "
                        "and --policy static --max-num-seqs 8; on the CPU fresh and warm are one case)")
    p.add_argument("--budget-s", type=float, default=280.0, help="wall-clock budget of the whole run")
    p.add_argument("--server-reserve-s", type=float, default=None,
                   help="skip a server case with less than this left (default 25 on CUDA, 5 on CPU)")
    p.add_argument("--steps-reserve-s", type=float, default=None, help="the same for decode/prefill (25 / 5)")
    p.add_argument("--hf-reserve-s", type=float, default=None, help="the same for the transformers run (40 / 5)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="logs, traces and bench summaries (default: a new temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="markdown report to write")
    p.add_argument("--json", type=Path, default=None, help="raw numbers to write")
    return p


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    cuda = is_cuda(args)
    defaults = {"context": (128, 32), "prefill_tokens": ([512, 2048], [64]), "reps": (20, 5), "server_reserve_s": (25.0, 5.0),
                "steps_reserve_s": (25.0, 5.0), "hf_reserve_s": (40.0, 5.0), "invariance_prompts": (10, 4),
                "invariance_longest": (1000, 40), "invariance_requests": (180, 24), "invariance_tokens": (32, 6),
                "invariance_budgets": ([2048, 256], [2048, 16]), "invariance_rounds": (2, 1),
                "invariance_reserve_s": (30.0, 5.0)}
    for name, (gpu, cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    args.reps = max(1, args.reps)
    for name in ("invariance_prompts", "invariance_longest", "invariance_requests", "invariance_tokens",
                 "invariance_rounds"):
        setattr(args, name, max(1, getattr(args, name)))
    if args.invariance and args.shape is None:
        args.shape = [("1b", ["invariance"]), ("135m", ["invariance"])] if cuda else [("tiny", ["invariance"])]
    elif args.invariance:
        args.shape = [(name, [s for s in SECTIONS if s in sections or s == "invariance"])
                      for name, sections in args.shape]
    if args.shape is None:
        args.shape = [("1b", list(SECTIONS)), ("135m", ["decode"])] if cuda else [("tiny", list(SECTIONS))]
    return args


def run_shape(shape: str, sections: list[str], run: Run, tokenizer: Path, models: Path) -> None:
    if not run.budget.allows(10.0):
        run.skip(f"{shape} (all)", f"{run.budget.left():.0f} s left of the budget")
        return
    model = make_checkpoint(shape, models / f"llama-{shape}", tokenizer, run.args)
    if "offline" in sections:
        section_offline(shape, model, run)
    steps = [s for s in sections if s in ("decode", "prefill")]
    if steps:
        try:
            section_steps(shape, model, steps, run)
        except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
            run.errors.append(f"{shape} {'/'.join(steps)}: {type(exc).__name__}: {exc}")
            log(f"!! {shape} {'/'.join(steps)} failed: {type(exc).__name__}: {exc}")
    if "hf" in sections:
        section_hf(shape, model, run)
    if "invariance" in sections:
        try:
            section_invariance(shape, model, run)
        except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
            run.errors.append(f"{shape} invariance: {type(exc).__name__}: {exc}")
            log(f"!! {shape} invariance failed: {type(exc).__name__}: {exc}")
    shutil.rmtree(model, ignore_errors=True)


def write_outputs(run: Run) -> None:
    run.meta["elapsed_s"] = time.monotonic() - run.budget.started
    for path, text in ((run.args.json, json.dumps(run.to_json(), indent=2)), (run.args.out, render(run))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            log(f"wrote {path}")
    if run.args.out is None:
        print(render(run))


def main(argv: list[str] | None = None) -> int:
    args = fill_defaults(build_parser().parse_args(argv))
    # The worker's own lines (KV cache size, graph memory, warm-up) from the runners built here.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    budget = Budget(args.budget_s)
    tree = ensure_jitney_importable()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="jitney-gpu-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(args, budget, workdir.resolve())
    if tree:
        run.notes.append(f"jitney is not installed here: imported through a link tree at {tree}")
    if not args.no_hf and any("hf" in sections for _, sections in args.shape):
        run.notes.append("transformers' continuous batching: the same requests, greedy, eos_token_id=-1, each "
                         "with its own max_new_tokens (add_request); its warm-up is not in the wall")
    run.meta = {**machine_meta(args), "argv": sys.argv[1:] if argv is None else argv, "workdir": str(run.workdir)}
    log(f"bench/gpu.py on {run.meta['card']}; workdir {run.workdir}; budget {args.budget_s:.0f} s")
    with tempfile.TemporaryDirectory(prefix="jitney-models-") as models:
        tokenizer = tokenizer_dir(args, Path(models))
        for shape, sections in args.shape:
            run_shape(shape, sections, run, tokenizer, Path(models))
    write_outputs(run)
    if tree:
        shutil.rmtree(tree, ignore_errors=True)   # links only
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
