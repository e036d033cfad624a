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
  ``bench/invariance_driver.py``: ``--invariance-prompts`` prompts (token
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
``make test`` (tests/test_bench_gpu.py). On CPU there is no Triton cache to
warm (the attention backend is torch's), so the fresh/warm pair is one case,
"default", and the servers get ``--num-blocks 1024`` instead of the 2 GiB
default cache.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import inspect
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # Last, not first: for ``bench.*``; an installed jitney (a wheel on PYTHONPATH) must not be
    # shadowed by the checkout's bare jitney/ folder.
    sys.path.append(str(ROOT))

if TYPE_CHECKING:
    from bench.invariance_driver import Output, Request
    from jitney.client.bench import WorkItem
    from jitney.engine.v1 import engine_pb2
    from jitney.worker.runner import ModelRunner

SECTIONS = ("offline", "decode", "prefill", "hf", "invariance")
SLOW_STEP_S = 0.05
CPU_SERVER_FLAGS = ["--num-blocks", "1024"]
_LLAMA_COMMON: dict[str, Any] = {"vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                                 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SHAPES: dict[str, dict[str, Any]] = {
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, "tie_word_embeddings": True, "rope_theta": 100000.0},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "tie_word_embeddings": False, "rope_theta": 500000.0},
    # vocab 49152 like the others, so the workloads' token ids fit.
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "tie_word_embeddings": True, "rope_theta": 10000.0,
             "max_position_embeddings": 1024},
}


# ---------------------------------------------------------------- import root

def ensure_jitney_importable() -> str | None:
    """Make ``jitney.*`` importable here and in child processes; the link tree made, if any.

    Installed, the package maps scheduler/, worker/ and client/ into
    ``jitney``; the checkout's jitney/ folder alone has none of them. The
    servers run ``python -m jitney.cli`` in the repository root
    (bench/server_harness.py), and ``-m`` puts the current folder first on
    sys.path, so that bare folder would shadow an installed wheel:
    PYTHONSAFEPATH=1 (Python >= 3.11) keeps the children from doing so.
    Without any install (only the repository on PYTHONPATH), a tree of links
    like ``make typecheck``'s is made and put first on sys.path and PYTHONPATH.
    """
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        import jitney.client  # noqa: F401
        import jitney.scheduler  # noqa: F401
        import jitney.worker  # noqa: F401
        return None
    except ModuleNotFoundError:
        pass
    tree = Path(tempfile.mkdtemp(prefix="jitney-import-"))
    (tree / "jitney").mkdir()
    for entry in (ROOT / "jitney").iterdir():
        if entry.name != "__pycache__":
            (tree / "jitney" / entry.name).symlink_to(entry)
    for part in ("scheduler", "worker", "client"):
        (tree / "jitney" / part).symlink_to(ROOT / part)
    for name in [m for m in sys.modules if m == "jitney" or m.startswith("jitney.")]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    paths = [str(tree), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    return str(tree)


# ---------------------------------------------------------------- plumbing

@dataclass
class Budget:
    """Wall-clock budget of the whole run."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def allows(self, reserve: float) -> bool:
        return self.left() >= reserve


@dataclass
class Run:
    """What the run measured, for the report and the JSON file."""

    args: argparse.Namespace
    budget: Budget
    workdir: Path
    meta: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    triton_cache: str | None = None   # the offline cases' cache, warm once they ran

    def shape(self, name: str) -> dict[str, Any]:
        return self.shapes.setdefault(name, {})

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        log(f"-- skipped {what}: {why}")

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "shapes": self.shapes, "skipped": self.skipped, "errors": self.errors,
                "notes": self.notes}


_STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress, with the seconds since the start."""
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {message}", flush=True)


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


def is_cuda(args: argparse.Namespace) -> bool:
    return bool(args.device == "cuda")


def dtype_name(args: argparse.Namespace) -> str:
    return "bfloat16" if is_cuda(args) else "float32"


def free_device_memory(args: argparse.Namespace) -> None:
    gc.collect()
    if is_cuda(args):
        import torch

        torch.cuda.empty_cache()


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "n/a"


def machine_meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    card = torch.cuda.get_device_name() if is_cuda(args) else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {"card": card, "device": args.device, "dtype": dtype_name(args), "torch": torch.__version__,
            "triton": version_of("triton"), "transformers": version_of("transformers"),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "budget_s": args.budget_s, "limit": args.limit}


# ---------------------------------------------------------------- checkpoints

def make_fast_tokenizer(path: Path, vocab_size: int) -> Path:
    """A byte-level BPE of exactly ``vocab_size`` tokens, saved to ``path`` in well under a second.

    Like bench/tiny_models.py's (its special tokens, EOS and chat template),
    but the ids past the byte alphabet are plain vocabulary entries, not
    added tokens: tiny_models' 49k added tokens take ~3 s to make and ~3 s
    for every server's scheduler to load, too slow for ``make test``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bench.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    vocab.update({f"<|extra_{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


def tokenizer_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """``--tokenizer``, or a local byte-level BPE of the model vocabulary (``make_fast_tokenizer``)."""
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    log(f"making a byte-level BPE tokenizer of {_LLAMA_COMMON['vocab_size']} tokens")
    return make_fast_tokenizer(scratch / "tokenizer", _LLAMA_COMMON["vocab_size"])


def llama_config(shape: str) -> Any:
    from transformers import LlamaConfig

    spec = {**_LLAMA_COMMON, **SHAPES[shape]}
    theta = spec.pop("rope_theta")
    return LlamaConfig(**spec, rope_parameters={"rope_type": "default", "rope_theta": theta})


def make_checkpoint(shape: str, path: Path, tokenizer: Path, args: argparse.Namespace) -> Path:
    """A random-weight LlamaForCausalLM of ``shape``, built on the device, saved with the tokenizer files."""
    import torch
    from transformers import LlamaForCausalLM

    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(llama_config(shape)).to(getattr(torch, dtype_name(args))).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    free_device_memory(args)
    for item in tokenizer.iterdir():
        if item.is_file():
            shutil.copy2(item, path / item.name)
    log(f"== {shape}: checkpoint made in {time.perf_counter() - started:.1f} s")
    return path


# ---------------------------------------------------------------- workloads

def load_items(args: argparse.Namespace, name: str) -> list[WorkItem]:
    from jitney.client.bench import load_workload

    items = load_workload(Path(args.workload_dir) / name)
    return items[: args.limit] if args.limit else items


def write_items(items: list[WorkItem], path: Path) -> Path:
    rows = [{"id": i.id, "arrival_s": i.arrival_s, "prompt_token_ids": i.prompt_token_ids,
             "max_tokens": i.max_tokens} for i in items]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- server cases

@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or leave alone, for ``None``) one environment variable for the block."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and old is None:
            os.environ.pop(name, None)
        elif value is not None and old is not None:
            os.environ[name] = old


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads (process-wide) set to ``n`` in the block; ``None`` leaves them.
    On the CPU the tiny model's steps are thread hand-offs: one thread runs them several times faster."""
    if n is None:
        yield
        return
    from bench.invariance_driver import torch_threads

    with torch_threads(n):
        yield


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
    from bench.server_harness import running_server

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


# ---------------------------------------------------------------- worker steps

def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def make_runner(model: Path, run: Run, max_seqs: int | None, num_blocks: int, *,
                batch_invariant: bool | None = None) -> ModelRunner:
    """``max_seqs`` None: the device's default seats (256 on CUDA); ``batch_invariant`` None: its default."""
    from jitney.worker.config import Device, DType, WorkerConfig
    from jitney.worker.runner import ModelRunner

    config = WorkerConfig(model=str(model), device=cast(Device, run.args.device),
                          dtype=cast(DType, dtype_name(run.args)), num_blocks=num_blocks, max_num_seqs=max_seqs,
                          max_num_batched_tokens=step_tokens(run), batch_invariant=batch_invariant)
    return ModelRunner(config)


def step_tokens(run: Run) -> int:
    """The runner's step budget: 2048 (or the prefill step, if larger), set explicitly."""
    return max(2048, *run.args.prefill_tokens)


def runner_blocks(run: Run, batches: list[int], block_size: int = 16) -> tuple[int, int]:
    """(blocks per decode sequence, total blocks) the decode and prefill measurements need."""
    per_seq = blocks_for(run.args.context + run.args.reps + 8, block_size)
    total = max(max(batches, default=1) * per_seq, blocks_for(max(run.args.prefill_tokens), block_size)) + 16
    return per_seq, total


def prefill_plans(batch: int, context: int, per_seq: int, budget_tokens: int) -> Iterator[engine_pb2.StepPlan]:
    """Plans that add and prefill sequences 1..batch with ``context`` tokens, within the step budget."""
    from jitney.engine.v1 import engine_pb2 as e

    group = max(1, budget_tokens // context)
    for first in range(0, batch, group):
        plan = e.StepPlan(step_id=1)
        for i in range(first, min(batch, first + group)):
            plan.new_sequences.add(seq_id=i + 1, sampling=e.SamplingConfig(seed=1))
            ids = [100 + (7 * i + j) % 40000 for j in range(context)]
            plan.chunks.add(seq_id=i + 1, start_position=0, token_ids=ids,
                            new_block_ids=list(range(i * per_seq, (i + 1) * per_seq)), sample=True)
        yield plan


def prompt_plan(step_id: int, seq_id: int, ids: list[int], blocks: list[int]) -> engine_pb2.StepPlan:
    """A new sequence's whole prompt as one chunk that samples."""
    from jitney.engine.v1 import engine_pb2 as e

    plan = e.StepPlan(step_id=step_id)
    plan.new_sequences.add(seq_id=seq_id, sampling=e.SamplingConfig(seed=1))
    plan.chunks.add(seq_id=seq_id, start_position=0, token_ids=ids, new_block_ids=blocks, sample=True)
    return plan


def decodes_ready(runner: ModelRunner, batch: int, run: Run, per_seq: int) -> None:
    """Sequences 1..batch prefilled with --context tokens, then three warm-up decode steps."""
    for plan in prefill_plans(batch, run.args.context, per_seq, step_tokens(run)):
        runner.execute(plan)
    for k in range(3):
        runner.execute(decode_plan(batch, run.args.context + k))


def decode_plan(batch: int, position: int) -> engine_pb2.StepPlan:
    from jitney.engine.v1 import engine_pb2 as e

    plan = e.StepPlan(step_id=2 + position)
    for i in range(batch):
        plan.chunks.add(seq_id=i + 1, start_position=position, token_ids=[5], sample=True)
    return plan


def timed_execute(runner: ModelRunner, plan: engine_pb2.StepPlan, expected: int) -> float:
    started = time.perf_counter()
    result = runner.execute(plan)
    elapsed = time.perf_counter() - started
    if len(result.token_ids) != expected:
        raise RuntimeError(f"step {plan.step_id}: {len(result.token_ids)} tokens, expected {expected}")
    return elapsed


def graph_replay_s(runner: ModelRunner, batch: int) -> tuple[float | None, str]:
    """The captured decode graph alone (``replay_seconds``: CUDA events), or None and why not."""
    if runner.graphs is None:
        return None, "no captured graphs (CPU or eager backend)"
    try:
        return runner.graphs.replay_seconds(batch), ""
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the rest still measures
        return None, f"replay_seconds({batch}) failed: {type(exc).__name__}: {exc}"


def measure_decode(runner: ModelRunner, batch: int, run: Run, per_seq: int) -> dict[str, Any]:
    """Wall time of ``execute()`` of decode steps of ``batch`` sequences, and the graph alone."""
    from jitney.engine.v1 import engine_pb2 as e

    context, warmup = run.args.context, 3
    for plan in prefill_plans(batch, context, per_seq, step_tokens(run)):
        runner.execute(plan)
    times = [timed_execute(runner, decode_plan(batch, context + k), batch) for k in range(warmup + run.args.reps)]
    graph_s, graph_note = graph_replay_s(runner, batch)
    runner.execute(e.StepPlan(step_id=10_000, freed_seq_ids=list(range(1, batch + 1))))
    kept = times[warmup:]
    return {"batch": batch, "context": context, "reps": len(kept), "execute_s_median": statistics.median(kept),
            "execute_s_min": min(kept), "graph_s": graph_s, "graph_note": graph_note}


def measure_prefill(runner: ModelRunner, run: Run, tokens: int) -> dict[str, Any]:
    """Wall time of ``execute()`` of one step of a single chunk of ``tokens``; fresh sequence each time."""
    from jitney.engine.v1 import engine_pb2 as e

    ids = [100 + (13 * j) % 40000 for j in range(tokens)]
    blocks = list(range(blocks_for(tokens, runner.config.block_size)))
    times = []
    for rep in range(2 + run.args.reps):   # a cold one, a warm-up, then the reps
        seq = 50_000 + rep
        times.append(timed_execute(runner, prompt_plan(20_000 + rep, seq, ids, blocks), 1))
        runner.execute(e.StepPlan(step_id=30_000 + rep, freed_seq_ids=[seq]))
    kept = times[2:]
    return {"tokens": tokens, "reps": len(kept), "first_s": times[0], "execute_s_median": statistics.median(kept),
            "execute_s_min": min(kept)}


def decode_batches(args: argparse.Namespace) -> list[int]:
    """--batch, capped by --limit where one is given (CPU plumbing: batches 1 and 2)."""
    batches = sorted(set(args.batch))
    if args.limit:
        batches = sorted({min(b, max(1, args.limit // 2)) for b in batches})
    return batches


def section_steps(shape: str, model: Path, sections: list[str], run: Run) -> None:
    """decode and/or prefill on one ModelRunner (it is freed before returning)."""
    if not run.budget.allows(run.args.steps_reserve_s):
        run.skip(f"{shape} {'/'.join(sections)}", f"{run.budget.left():.0f} s left of the budget")
        return
    batches = decode_batches(run.args) if "decode" in sections else []
    per_seq, total = runner_blocks(run, batches)
    # The Triton cache the servers warmed (CUDA): the runner does not compile the kernels again.
    with env_var("TRITON_CACHE_DIR", run.triton_cache):
        started = time.perf_counter()
        runner = make_runner(model, run, max(batches, default=1), total)
        run.shape(shape).update(runner_init_s=time.perf_counter() - started,
                                runner_warmup_s=getattr(runner, "warmup_seconds", None))
        log(f"== {shape}: ModelRunner ready in {time.perf_counter() - started:.1f} s ({total} KV blocks)")
        try:
            steps_decode(shape, runner, batches, per_seq, run)
            if "prefill" in sections:
                steps_prefill(shape, runner, run)
        finally:
            del runner
            free_device_memory(run.args)


def steps_decode(shape: str, runner: ModelRunner, batches: list[int], per_seq: int, run: Run) -> None:
    for batch in batches:
        if not run.budget.allows(5.0):
            run.skip(f"{shape} decode batch {batch}", "budget spent")
            continue
        row = measure_decode(runner, batch, run, per_seq)
        run.shape(shape).setdefault("decode", []).append(row)
        graph = f"{row['graph_s'] * 1e3:.2f} ms" if row["graph_s"] is not None else f"n/a ({row['graph_note']})"
        log(f"   decode batch {batch}: execute() {row['execute_s_median'] * 1e3:.2f} ms median, graph {graph}")


def steps_prefill(shape: str, runner: ModelRunner, run: Run) -> None:
    if not run.budget.allows(5.0):
        run.skip(f"{shape} prefill", "budget spent")
        return
    graphs = runner.graphs
    mixed = list(graphs.mixed_tokens) if graphs is not None else []
    for tokens in run.args.prefill_tokens:
        modes = ["graph", "eager"] if mixed and tokens <= mixed[-1] else ["eager"]
        for mode in modes:
            if graphs is not None and mixed:
                # The same runner with its mixed-step graphs set aside: the eager path, side by side.
                graphs.mixed_tokens = mixed if mode == "graph" else []
            row = measure_prefill(runner, run, tokens)
            row["mode"] = mode
            run.shape(shape).setdefault("prefill", []).append(row)
            log(f"   prefill {row['tokens']} tokens ({mode}): execute() {row['execute_s_median'] * 1e3:.2f} ms "
                f"median (first {row['first_s'] * 1e3:.1f} ms)")
        if graphs is not None and mixed:
            graphs.mixed_tokens = mixed
    if run.args.profile and is_cuda(run.args):
        profile_steps(shape, runner, run)
    if run.args.host_profile:
        host_profile_steps(shape, runner, run)


def profile_steps(shape: str, runner: ModelRunner, run: Run) -> None:
    """torch.profiler over decode steps (batch 1 and the largest) and a 2048-token prefill: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from jitney.engine.v1 import engine_pb2 as e

    out = (run.args.out.parent if run.args.out else Path(".")) / f"profile-{shape}.txt"
    per_seq, _ = runner_blocks(run, [])
    texts = []
    for batch in sorted({1, max(decode_batches(run.args))}):
        decodes_ready(runner, batch, run, per_seq)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(3, 8):
                runner.execute(decode_plan(batch, run.args.context + k))
        runner.execute(e.StepPlan(step_id=10_000, freed_seq_ids=list(range(1, batch + 1))))
        texts.append(f"== decode batch {batch}, 5 steps, by CPU total\n"
                     + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        texts.append(f"== decode batch {batch}, 5 steps, by device total\n"
                     + prof.key_averages().table(sort_by="device_time_total", row_limit=25))
    tokens = max(run.args.prefill_tokens)
    ids, blocks = [100 + j % 40000 for j in range(tokens)], list(range(blocks_for(tokens, 16)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for rep in range(2):
            runner.execute(prompt_plan(40_000 + rep, 60_000 + rep, ids, blocks))
            runner.execute(e.StepPlan(step_id=41_000 + rep, freed_seq_ids=[60_000 + rep]))
    texts.append(f"== prefill {tokens} tokens, 2 steps, by device total\n"
                 + prof.key_averages().table(sort_by="device_time_total", row_limit=30))
    out.write_text("\n\n".join(texts))
    log(f"   profile: {out}")


def host_profile_steps(shape: str, runner: ModelRunner, run: Run) -> None:
    """cProfile of ``execute()``: decode steps (batch 1 and the largest) and prefill steps of the
    largest --prefill-tokens, by own time and by cumulative time: where the host's time goes."""
    import cProfile
    import pstats

    from jitney.engine.v1 import engine_pb2 as e

    out = (run.args.out.parent if run.args.out else Path(".")) / f"host-profile-{shape}.txt"
    per_seq, _ = runner_blocks(run, [])
    steps = max(5, run.args.reps)
    texts = []

    def table(prof: cProfile.Profile, title: str, per: int) -> None:
        """The 30 functions of most own time and of most cumulative time, in µs per step."""
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        rows = [(tt, ct, nc, f"{Path(file).name}:{line}({name})") for (file, line, name), (_, nc, tt, ct, _)
                in stats.items()]
        for key, index in (("own", 0), ("cumulative", 1)):
            lines = [f"== {title}, by {key} time (µs per step)", f"{'own':>9} {'cum':>9} {'calls':>7}  function"]
            for tt, ct, nc, where in sorted(rows, key=lambda r: -float(r[index]))[:30]:
                lines.append(f"{tt / per * 1e6:9.1f} {ct / per * 1e6:9.1f} {nc / per:7.1f}  {where}")
            texts.append("\n".join(lines))

    for batch in sorted({1, max(decode_batches(run.args))}):
        decodes_ready(runner, batch, run, per_seq)
        prof = cProfile.Profile()
        started = time.perf_counter()
        prof.enable()
        for k in range(3, 3 + steps):
            runner.execute(decode_plan(batch, run.args.context + k))
        prof.disable()
        elapsed = (time.perf_counter() - started) / steps
        runner.execute(e.StepPlan(step_id=10_000, freed_seq_ids=list(range(1, batch + 1))))
        table(prof, f"decode batch {batch}, {steps} steps ({elapsed * 1e3:.2f} ms a step under cProfile)", steps)
    tokens = max(run.args.prefill_tokens)
    ids, blocks = [100 + j % 40000 for j in range(tokens)], list(range(blocks_for(tokens, 16)))
    prof = cProfile.Profile()
    for rep in range(3):
        plan = prompt_plan(42_000 + rep, 62_000 + rep, ids, blocks)
        if rep:
            prof.enable()
        runner.execute(plan)
        prof.disable()
        runner.execute(e.StepPlan(step_id=43_000 + rep, freed_seq_ids=[62_000 + rep]))
    table(prof, f"prefill {tokens} tokens, 2 steps", 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(texts))
    log(f"   host profile: {out}")


# ---------------------------------------------------------------- batch invariance

INVARIANCE_TEMPERATURE, INVARIANCE_TOP_P, INVARIANCE_SEED = 0.8, 0.9, 1000
INVARIANCE_PREEMPT = {6: [0], 13: [3]}   # before step s, preempt the running requests at these positions
INVARIANCE_RULE = 1.10                   # default --batch-invariant on for CUDA when on/off <= this


def _prompt_ids(start: int, n: int) -> tuple[int, ...]:
    return tuple(5 + (7919 * (start + k) + 104729 * ((start + k) // 97)) % 40000 for k in range(n))


def invariance_prompts(n: int, longest: int) -> list[tuple[int, ...]]:
    """``n`` prompts (token ids) of lengths spread geometrically from 1 to ``longest``; the even
    ones are prefixes of one token stream (prefix-cache hits across prompts), the odd ones their own."""
    lengths = [max(1, round(longest ** (i / max(1, n - 1)))) for i in range(n)]
    return [_prompt_ids(0 if i % 2 == 0 else 50_000 * i, length) for i, length in enumerate(lengths)]


def invariance_jobs(prompts: list[tuple[int, ...]], max_tokens: int) -> list[Request]:
    """Each prompt greedy and seeded (T 0.8, top_p 0.9, its own seed in every request)."""
    from bench.invariance_driver import Request

    jobs = []
    for i, prompt in enumerate(prompts):
        jobs.append(Request(prompt, max_tokens))
        jobs.append(Request(prompt, max_tokens, temperature=INVARIANCE_TEMPERATURE, top_p=INVARIANCE_TOP_P,
                            seed=INVARIANCE_SEED + i))
    return jobs


def invariance_arrivals(requests: list[Request]) -> dict[int, list[tuple[int, Request]]]:
    """Waves of 1, 2, 4, 8, ... requests, one every 2 steps: prefills land among running decodes."""
    at: dict[int, list[tuple[int, Request]]] = {}
    first, size, step = 0, 1, 0
    while first < len(requests):
        at[step] = [(rid, requests[rid]) for rid in range(first, min(len(requests), first + size))]
        first, size, step = first + size, size * 2, step + 2
    return at


def invariance_blocks(run: Run, requests: int, prompts: list[tuple[int, ...]], block_size: int = 16) -> int:
    """KV blocks for every request at once (no prefix sharing counted) and for the step measurements."""
    per_request = max(blocks_for(len(p) + run.args.invariance_tokens, block_size) for p in prompts)
    _, steps = runner_blocks(run, invariance_step_batches(run.args), block_size)
    return max(requests * per_request + 16, steps)


def invariance_step_batches(args: argparse.Namespace) -> list[int]:
    """Decode batches of the cost measurement: 1 and the largest --batch (64), capped like decode's."""
    return decode_batches(argparse.Namespace(batch=[1, max(args.batch)], limit=args.limit))


def compare_outputs(ref: Output, got: Output) -> tuple[bool, bool, float]:
    """(token ids differ, log-probs differ, largest |logprob difference| before the first other token)."""
    agree = next((k for k, (a, b) in enumerate(zip(ref.tokens, got.tokens)) if a != b), len(ref.tokens))
    delta = max((abs(a - b) for a, b in zip(ref.logprobs[:agree], got.logprobs[:agree])), default=0.0)
    return ref.tokens != got.tokens, ref.logprobs != got.logprobs, delta


def invariance_experiment(shape: str, runner: ModelRunner, flag: bool, run: Run) -> list[dict[str, Any]]:
    """The jobs alone (the reference), then the requests batched at each budget; one row per budget."""
    import random

    from bench.invariance_driver import BatchDriver, first_difference, preempt_by_position, run_alone

    args = run.args
    prompts = invariance_prompts(args.invariance_prompts, args.invariance_longest)
    jobs = invariance_jobs(prompts, args.invariance_tokens)
    started = time.perf_counter()
    alone = {job: run_alone(runner, job) for job in jobs}
    alone_s = time.perf_counter() - started
    requests = [jobs[k % len(jobs)] for k in range(args.invariance_requests)]
    random.Random(0).shuffle(requests)
    rows = []
    for budget in args.invariance_budgets:
        if budget > runner.limits.max_num_batched_tokens:
            run.skip(f"{shape} invariance budget {budget}",
                     f"over the runner's step budget {runner.limits.max_num_batched_tokens}")
            continue
        started = time.perf_counter()
        driver = BatchDriver(runner, budget=budget)
        outputs = driver.run(invariance_arrivals(requests), preempt=preempt_by_position(INVARIANCE_PREEMPT))
        seconds = time.perf_counter() - started
        row: dict[str, Any] = {
            "batch_invariant": flag, "budget": budget, "requests": len(outputs), "tokens_differ": 0,
            "logprobs_differ": 0, "max_logprob_delta": 0.0, "alone_s": alone_s, "seconds": seconds,
            "steps": len(driver.steps), "largest_step_seqs": max(s.seqs for s in driver.steps),
            "cached_prompt_tokens": sum(o.cached_tokens for o in outputs.values()),
            "preemptions": sum(len(o.preempted_after) for o in outputs.values()), "examples": []}
        for rid, got in sorted(outputs.items()):
            ref = alone[got.request]
            tokens, logprobs, delta = compare_outputs(ref, got)
            row["tokens_differ"] += tokens
            row["logprobs_differ"] += logprobs
            row["max_logprob_delta"] = max(row["max_logprob_delta"], delta)
            if logprobs and len(row["examples"]) < 3:
                row["examples"].append(f"request {rid} ({got.request.describe()}): {first_difference(ref, got)}")
        rows.append(row)
        log(f"   invariance {'on' if flag else 'off'}, budget {budget}: {row['requests']} requests in "
            f"{row['steps']} steps ({seconds:.1f} s), {row['tokens_differ']} differ in token ids, "
            f"{row['logprobs_differ']} in log-probs")
    return rows


def invariance_steps(runner: ModelRunner, flag: bool, round_no: int, run: Run) -> list[dict[str, Any]]:
    """Decode at batch 1 and 64, one prefill step of the largest --prefill-tokens (2048): rows tagged."""
    per_seq, _ = runner_blocks(run, invariance_step_batches(run.args))
    rows = [{"what": f"decode batch {b}", **measure_decode(runner, b, run, per_seq)}
            for b in invariance_step_batches(run.args)]
    graphs = runner.graphs
    mixed = list(graphs.mixed_tokens) if graphs is not None else []
    tokens = max(run.args.prefill_tokens)
    if graphs is not None and mixed and tokens <= mixed[-1]:
        graphs.mixed_tokens = []    # eager, as a step over the graphs' largest is
    try:
        rows.append({"what": f"prefill {tokens} tokens", **measure_prefill(runner, run, tokens)})
    finally:
        if graphs is not None:
            graphs.mixed_tokens = mixed
    for row in rows:
        row.update(batch_invariant=flag, round=round_no)
    return rows


def section_invariance(shape: str, model: Path, run: Run) -> None:
    """--batch-invariant off and on: the experiment on ModelRunners, their step costs, offline-64 servers."""
    args = run.args
    data = run.shape(shape).setdefault("invariance", {})
    prompts = invariance_prompts(args.invariance_prompts, args.invariance_longest)
    data["config"] = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                      "jobs": 2 * len(prompts), "requests": args.invariance_requests,
                      "max_tokens": args.invariance_tokens, "budgets": args.invariance_budgets,
                      "temperature": INVARIANCE_TEMPERATURE, "top_p": INVARIANCE_TOP_P,
                      "seeds": f"{INVARIANCE_SEED} + prompt index", "preempt": INVARIANCE_PREEMPT,
                      "rounds": args.invariance_rounds, "dtype": dtype_name(args)}
    data.update(rows=[], runners=[], steps=[])
    if is_cuda(args) and run.triton_cache is None:
        run.triton_cache = tempfile.mkdtemp(prefix="jitney-triton-cache-")   # the servers below read it warm
    with env_var("TRITON_CACHE_DIR", run.triton_cache), cpu_threads(1 if not is_cuda(args) else None):
        try:
            invariance_runners(shape, model, run, data)
        finally:
            free_device_memory(args)
    for what in dict.fromkeys(row["what"] for row in data["steps"]):
        medians = {flag: _step_median(data["steps"], what, flag) for flag in (False, True)}
        log(f"   {what}: " + ", ".join(f"{_on_off(flag)} {_ms(m)} ms" for flag, m in medians.items()))
    if shape in args.invariance_offline_shapes:
        invariance_offline(shape, model, run, data)
    else:
        run.notes.append(f"{shape} invariance: no offline-64 pair (only for "
                         f"{', '.join(args.invariance_offline_shapes) or 'no shape'}: --invariance-offline-shapes)")


def invariance_runners(shape: str, model: Path, run: Run, data: dict[str, Any]) -> None:
    """A runner per setting (both kept): the experiment on each, then their step timings, alternating."""
    args = run.args
    total = invariance_blocks(run, args.invariance_requests, invariance_prompts(args.invariance_prompts,
                                                                                args.invariance_longest))
    runners: dict[bool, ModelRunner] = {}
    for flag in (False, True):
        if not run.budget.allows(args.invariance_reserve_s):
            run.skip(f"{shape} invariance {_on_off(flag)}", f"{run.budget.left():.0f} s left of the budget")
            continue
        try:
            started = time.perf_counter()
            runner = make_runner(model, run, None, total, batch_invariant=flag)
            info = {"batch_invariant": flag, "resolved": runner.batch_invariant,
                    "init_s": time.perf_counter() - started, "warmup_s": getattr(runner, "warmup_seconds", None)}
            data["runners"].append(info)
            log(f"== {shape} invariance: ModelRunner --{'' if flag else 'no-'}batch-invariant ready in "
                f"{info['init_s']:.1f} s ({total} KV blocks)")
            data["rows"] += invariance_experiment(shape, runner, flag, run)
            runners[flag] = runner
        except Exception as exc:  # noqa: BLE001 - recorded with its traceback; the other setting still runs
            run.errors.append(f"{shape} invariance {_on_off(flag)}: {type(exc).__name__}: {str(exc)[-2000:]}")
            log(f"!! {shape} invariance {_on_off(flag)} failed:\n{traceback.format_exc()}")
    try:
        for round_no in range(1, args.invariance_rounds + 1):   # off, on, off, on: drift falls on both
            for flag in list(runners):
                if not run.budget.allows(5.0):
                    run.skip(f"{shape} invariance steps ({_on_off(flag)}, round {round_no})", "budget spent")
                    continue
                data["steps"] += invariance_steps(runners[flag], flag, round_no, run)
    except Exception as exc:  # noqa: BLE001 - recorded; the offline pair still runs
        run.errors.append(f"{shape} invariance steps: {type(exc).__name__}: {str(exc)[-2000:]}")
        log(f"!! {shape} invariance steps failed:\n{traceback.format_exc()}")


def invariance_offline(shape: str, model: Path, run: Run, data: dict[str, Any]) -> None:
    """offline-64 on `jitney serve --no-batch-invariant` and `--batch-invariant`, alternating."""
    items = load_items(run.args, "offline-64.jsonl")
    workload = write_items(items, run.workdir / f"offline-64-{len(items)}.jsonl")
    cases = data.setdefault("offline", [])
    for round_no in range(1, run.args.invariance_rounds + 1):
        for flag in (False, True):
            name = f"invariant-{'on' if flag else 'off'}-{round_no}"
            if not run.budget.allows(run.args.server_reserve_s):
                run.skip(f"{shape} invariance offline {name}", f"{run.budget.left():.0f} s left of the budget")
                continue
            flags = ["--batch-invariant" if flag else "--no-batch-invariant"]
            try:
                case = run_server_case(name, model, flags, workload, run, run.triton_cache)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                run.errors.append(f"{shape} invariance offline {name}: {type(exc).__name__}: {str(exc)[-2000:]}")
                log(f"!! {shape} invariance offline {name} failed: {exc}")
                continue
            case.update(batch_invariant=flag, round=round_no)
            cases.append(case)
            if case["errors"] or case["exit_code"]:
                run.errors.append(f"{shape} invariance offline {name}: {case['errors']} of {case['requests']} "
                                  f"requests failed (`jitney bench` exit {case['exit_code']})")
    ratio = offline_ratio(cases)
    if ratio is not None:
        data["offline_wall_ratio"] = ratio
        log(f"   offline-64 wall, batch-invariant on / off (medians): {ratio:.3f}")


def _step_median(steps: list[dict[str, Any]], what: str, flag: bool) -> float | None:
    """The median over rounds of a step's per-round medians, or None."""
    got = [r["execute_s_median"] for r in steps if r["what"] == what and r["batch_invariant"] == flag]
    return statistics.median(got) if got else None


def _offline_median(cases: list[dict[str, Any]], flag: bool) -> float | None:
    walls = [c["wall_s"] for c in cases if c["batch_invariant"] == flag and not c["errors"]]
    return statistics.median(walls) if walls else None


def offline_ratio(cases: list[dict[str, Any]]) -> float | None:
    """Median offline-64 wall with --batch-invariant / median without; None without both."""
    on, off = _offline_median(cases, True), _offline_median(cases, False)
    return on / off if on is not None and off else None


# ---------------------------------------------------------------- transformers baseline

def _kwargs_for(func: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``func`` accepts (transformers' API moves between 5.x releases)."""
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def hf_manager(model: Any, items: list[WorkItem]) -> Any:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(i.max_tokens for i in items), do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    hints: Any = None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(i.prompt_token_ids) for i in items),
                              max_generated_length=max(i.max_tokens for i in items), num_requests=len(items))
    except (ImportError, TypeError):
        pass
    init = model.init_continuous_batching
    return init(**_kwargs_for(init, generation_config=config, workload_hints=hints,
                              continuous_batching_config=hf_cpu_config(items, model)))


def hf_cpu_config(items: list[WorkItem], model: Any) -> Any:
    """On CPU a small paged cache (its default takes a share of all host memory: seconds to allocate).
    On CUDA None: transformers sizes it, as generate_batch does."""
    if model.device.type == "cuda":
        return None
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return None
    pages = sum(math.ceil((len(i.prompt_token_ids) + i.max_tokens) / 256) for i in items) + 8
    return ContinuousBatchingConfig(**_kwargs_for(ContinuousBatchingConfig, num_blocks=pages, page_size=256,
                                                  max_batch_tokens=512))


def hf_generate(manager: Any, items: list[WorkItem], deadline: float) -> tuple[float, dict[str, int]]:
    """Add every request, collect every result; (wall, tokens per request id)."""
    produced: dict[str, int] = {}
    started = time.perf_counter()
    for item in items:
        manager.add_request(**_kwargs_for(manager.add_request, input_ids=item.prompt_token_ids,
                                          request_id=item.id, max_new_tokens=item.max_tokens, eos_token_id=-1))
    while len(produced) < len(items):
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers continuous batching: {len(produced)}/{len(items)} done at the budget")
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread ended early")
            continue
        if result.is_finished():
            if getattr(result, "error", None):
                raise RuntimeError(f"transformers request {result.request_id}: {result.error}")
            produced[result.request_id] = len(result.generated_tokens)
    return time.perf_counter() - started, produced


def run_hf(model_dir: Path, items: list[WorkItem], run: Run) -> dict[str, Any]:
    """transformers' continuous batching on the same requests: greedy, no EOS, per-request max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype_name(run.args)))
    model = model.to(run.args.device).eval()
    manager = hf_manager(model, items)
    warmup_s = 0.0
    try:
        with torch.no_grad():   # as generate_batch runs it
            if hasattr(manager, "warmup"):   # builds the batch processor, captures CUDA graphs
                started = time.perf_counter()
                manager.warmup()
                warmup_s = time.perf_counter() - started
            manager.start()
            wall, produced = hf_generate(manager, items, time.monotonic() + run.budget.left())
    finally:
        # hard_stop: nothing is pending after a full run; after a timeout, do not wait for the rest.
        manager.stop(**_kwargs_for(manager.stop, block=True, timeout=30, hard_stop=True))
        del model
        free_device_memory(run.args)
    want = {i.id: i.max_tokens for i in items}
    output_tokens = sum(min(produced.get(k, 0), v) for k, v in want.items())
    return {"case": "transformers continuous batching", "requests": len(items),
            "completed": sum(produced.get(k) == v for k, v in want.items()), "wall_s": wall,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / wall if wall > 0 else 0.0,
            "warmup_s": warmup_s, "per_request_max_new_tokens": True}


def section_hf(shape: str, model: Path, run: Run) -> None:
    if run.args.no_hf:
        run.skip(f"{shape} hf", "--no-hf")
        return
    if not run.budget.allows(run.args.hf_reserve_s):
        run.skip(f"{shape} hf", f"{run.budget.left():.0f} s left of the budget")
        return
    log(f"== {shape} transformers continuous batching ({version_of('transformers')})")
    try:
        row = run_hf(model, load_items(run.args, "offline-64.jsonl"), run)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is skipped with its reason
        run.skip(f"{shape} hf", f"{type(exc).__name__}: {str(exc)[:500]}")
        return
    run.shape(shape)["hf"] = row
    log(f"   wall {row['wall_s']:.2f} s, {row['completed']}/{row['requests']} completed "
        f"(warm-up {row['warmup_s']:.1f} s, not timed)")


# ---------------------------------------------------------------- the report

def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _offline_row(shape: str, case: dict[str, Any], hf_wall: float | None) -> str:
    first = " / ".join(f"{d * 1e3:.0f}" for d in case["first_steps_s"]) or "n/a"
    ratio = f"{hf_wall / case['wall_s']:.1f}x" if hf_wall and case["wall_s"] > 0 else "n/a"
    return (f"| {shape} | {case['case']} | {case['wall_s']:.2f} | {case['output_tok_s']:.0f} | "
            f"{case['ttft_s']['p50']:.3f} | {case['steps']} | {case['max_step_s'] * 1e3:.1f} | {first} | "
            f"{case['steps_over_50ms']} | {case['startup_s']:.1f} | {case['completed']}/{case['requests']} | "
            f"{ratio} |")


def offline_table(run: Run) -> list[str]:
    lines = ["## offline-64 (`jitney serve` + `jitney bench`)", "",
             "Wall from the first request to the last token; steps from the server's `--trace` (every step "
             "after Ready, `dur` as the scheduler sees it). \"vs HF CB\": transformers' continuous batching "
             "wall / this wall (higher is better).", "",
             "| shape | case | wall s | output tok/s | TTFT p50 s | steps | longest step ms | first two steps ms "
             "| steps > 50 ms | start-up s | completed | vs HF CB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, data in run.shapes.items():
        hf = data.get("hf")
        hf_wall = hf["wall_s"] if hf else None
        lines += [_offline_row(shape, case, hf_wall) for case in data.get("offline", [])]
        if hf:
            lines.append(f"| {shape} | {hf['case']} (warm-up {hf['warmup_s']:.1f} s not timed) | "
                         f"{hf['wall_s']:.2f} | {hf['output_tok_s']:.0f} | | | | | | | "
                         f"{hf['completed']}/{hf['requests']} | 1.0x |")
    return lines


def startup_section(run: Run) -> list[str]:
    lines = ["## Server start-up lines", ""]
    for shape, data in run.shapes.items():
        for case in data.get("offline", []):
            lines += [f"{shape}, {case['case']} (SERVING after {case['startup_s']:.1f} s):", "", "```",
                      *(case["startup_lines"] or ["(none found in the log)"]), "```", ""]
    return lines


def decode_table(run: Run) -> list[str]:
    lines = ["## Decode step (worker `ModelRunner.execute()`)", "",
             "Wall time around `execute()` of one decode step of B sequences (each with "
             f"{run.args.context}+ tokens of context), median and best of the reps after 3 warm-ups; "
             "\"graph\": one replay of the captured decode graph alone (CUDA events).", "",
             "| shape | batch | execute() median ms | execute() best ms | graph ms |", "|---|---|---|---|---|"]
    for shape, data in run.shapes.items():
        for row in data.get("decode", []):
            graph = _ms(row["graph_s"]) if row["graph_s"] is not None else f"n/a ({row['graph_note']})"
            lines.append(f"| {shape} | {row['batch']} | {_ms(row['execute_s_median'])} | "
                         f"{_ms(row['execute_s_min'])} | {graph} |")
    return lines


def prefill_table(run: Run) -> list[str]:
    lines = ["## Prefill step (worker `ModelRunner.execute()`)", "",
             "One step of a single chunk of N prompt tokens (a fresh sequence each time): the first (cold), "
             "then, after one more warm-up, median and best of the reps. \"step\": a captured mixed-step graph "
             "(steps up to 512 tokens) or eager; up to 512 tokens both run, on the same runner.", "",
             "| shape | tokens | step | execute() median ms | execute() best ms | first ms |",
             "|---|---|---|---|---|---|"]
    for shape, data in run.shapes.items():
        for row in data.get("prefill", []):
            lines.append(f"| {shape} | {row['tokens']} | {row.get('mode', 'eager')} | {_ms(row['execute_s_median'])} | "
                         f"{_ms(row['execute_s_min'])} | {_ms(row['first_s'])} |")
    return lines


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}"


def _ratio(on: float | None, off: float | None) -> str:
    return f"{on / off:.3f}" if on is not None and off else "n/a"


def invariance_verdict(shape: str, data: dict[str, Any], run: Run) -> str:
    """One line: the offline-64 cost against the rule, and whether "on" held on this device."""
    ratio = data.get("offline_wall_ratio")
    on_rows = [r for r in data.get("rows", []) if r["batch_invariant"]]
    differ = sum(r["logprobs_differ"] for r in on_rows)
    held = (f"with it on, {differ} of {sum(r['requests'] for r in on_rows)} batched requests differ from "
            "their alone run" if on_rows else "its experiment did not run")
    if ratio is None:
        return f"{shape}: no offline-64 pair measured; {held}."
    cost = f"offline-64 wall on / off = {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)"
    if not is_cuda(run.args):
        return f"{shape}: {cost}; {held} (a CPU run: not the CUDA default's measurement)."
    within = ratio <= INVARIANCE_RULE
    rule = (f"within the {(INVARIANCE_RULE - 1) * 100:.0f}% rule" if within
            else f"over the {(INVARIANCE_RULE - 1) * 100:.0f}% rule")
    then = ("the rule says: default it on for CUDA" if within and differ == 0
            else "not invariant on this card yet: fix that before defaulting it on" if differ
            else "the CUDA default stays off")
    return f"{shape}: {cost}, {rule}; {held}: {then}."


def invariance_report(run: Run) -> list[str]:
    shapes = {shape: data["invariance"] for shape, data in run.shapes.items() if "invariance" in data}
    if not shapes:
        return []
    a = run.args
    lines = ["## Batch invariance (`--batch-invariant` off and on)", "",
             f"Worker `ModelRunner`s ({dtype_name(a)}), one per setting, driven by `bench/invariance_driver.py`: "
             f"{a.invariance_prompts} prompts (token ids, lengths spread from 1 to {a.invariance_longest}; the "
             f"even ones share a prefix), each greedy and seeded (T {INVARIANCE_TEMPERATURE}, top_p "
             f"{INVARIANCE_TOP_P}, seed {INVARIANCE_SEED} + prompt), {a.invariance_tokens} tokens, run alone: "
             f"the reference. Then {a.invariance_requests} requests cycling over those (shuffled), arriving in "
             "waves of 1, 2, 4, ... every 2 steps, continuous batching at each step budget (chunked prefill, "
             "prefix-cache hits, two preemptions). \"differ\": requests whose token ids / log-probs are not "
             "bit-identical to the alone run; max |dlogprob| over the tokens before the first other token id.", "",
             "| shape | batch-invariant | budget | requests | token ids differ | logprobs differ | max \\|dlogprob\\| "
             "| cached prompt tokens | preemptions | steps | largest step seqs | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, data in shapes.items():
        for r in data.get("rows", []):
            lines.append(f"| {shape} | {_on_off(r['batch_invariant'])} | {r['budget']} | {r['requests']} | "
                         f"{r['tokens_differ']} | {r['logprobs_differ']} | {r['max_logprob_delta']:.3g} | "
                         f"{r['cached_prompt_tokens']} | {r['preemptions']} | {r['steps']} | "
                         f"{r['largest_step_seqs']} | {r['seconds']:.1f} |")
        for flag in (False, True):
            rows = [r for r in data.get("rows", []) if r["batch_invariant"] == flag]
            if rows:
                lines.append(f"| {shape} | {_on_off(flag)} | all | {sum(r['requests'] for r in rows)} | "
                             f"{sum(r['tokens_differ'] for r in rows)} | {sum(r['logprobs_differ'] for r in rows)} "
                             "| | | | | | |")
    examples = [f"{shape}, {_on_off(r['batch_invariant'])}, budget {r['budget']}: {e}"
                for shape, data in shapes.items() for r in data.get("rows", []) for e in r["examples"][:1]]
    if examples:
        lines += ["", "First differences (one per row):", "", *[f"- {e}" for e in examples]]
    lines += ["", "### What it costs", "",
              "Step rows: `execute()` median ms (the median over the rounds, off and on alternating, of each "
              "round's median), on the same runners; offline-64: `jitney serve --no-batch-invariant` / "
              "`--batch-invariant` replaying it, alternating, median wall s (each run in the table below).", "",
              "| shape | measure | off | on | on / off |", "|---|---|---|---|---|"]
    for shape, data in shapes.items():
        steps = data.get("steps", [])
        for what in dict.fromkeys(r["what"] for r in steps):
            off, on = _step_median(steps, what, False), _step_median(steps, what, True)
            lines.append(f"| {shape} | {what}, ms | {_ms(off)} | {_ms(on)} | {_ratio(on, off)} |")
        cases = data.get("offline", [])
        if cases:
            off, on = _offline_median(cases, False), _offline_median(cases, True)
            lines.append(f"| {shape} | offline-64 wall (median), s | "
                         f"{'n/a' if off is None else f'{off:.3f}'} | {'n/a' if on is None else f'{on:.3f}'} | "
                         f"{_ratio(on, off)} |")
        init = {info["batch_invariant"]: info["init_s"] for info in data.get("runners", [])}
        if init:
            lines.append(f"| {shape} | runner start-up (load, warm-up, compiles), s | {_s(init.get(False))} | "
                         f"{_s(init.get(True))} | {_ratio(init.get(True), init.get(False))} |")
    lines += ["", "| shape | case | flags | wall s | output tok/s | TTFT p50 s | steps | start-up s | completed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for shape, data in shapes.items():
        for c in data.get("offline", []):
            lines.append(f"| {shape} | {c['case']} | `{' '.join(c['flags'])}` | {c['wall_s']:.3f} | "
                         f"{c['output_tok_s']:.0f} | {c['ttft_s']['p50']:.3f} | {c['steps']} | {c['startup_s']:.1f} | "
                         f"{c['completed']}/{c['requests']} |")
    lines += ["", *[f"- {invariance_verdict(shape, data, run)}" for shape, data in shapes.items()]]
    return lines


def render(run: Run) -> str:
    meta = run.meta
    head = [f"# Jitney GPU benchmark: {meta['card']}", "",
            f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
            f"Python {meta['python']}; {meta['dtype']} random weights; "
            f"`bench/gpu.py {' '.join(meta['argv'])}` in {meta['elapsed_s']:.0f} s "
            f"(budget {meta['budget_s']:.0f} s).", ""]
    tail = ["## Skipped", "", *([f"- {s}" for s in run.skipped] or ["- nothing"]), ""]
    if run.errors:
        tail += ["## Errors", "", *[f"- {e}" for e in run.errors], ""]
    if run.notes:
        tail += ["## Notes", "", *[f"- {n}" for n in run.notes], ""]
    invariance = invariance_report(run)
    body = [*offline_table(run), "", *decode_table(run), "", *prefill_table(run), "",
            *([*invariance, ""] if invariance else []), *startup_section(run)]
    return "\n".join(head + body + tail) + "\n"


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
                        "tokens made here, like bench/tiny_models.py's; on the GPU machine .device-kit/tok)")
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
