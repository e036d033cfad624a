#!/usr/bin/env python3
"""The transformers fallback's cost against the native path, on the same model.

    .venv/bin/python bench/transformers_fallback.py [--dtype float32 bfloat16] [--batch 1 8]
        [--prefill 512] [--context 100] [--reps 10] [--threads 1] [--hidden 512] [--layers 8]
        [--vocab 4096] [--model PATH]

One random Llama (``tests/support/tiny_models.make_tiny_llama``; hidden 512, 8
layers, 4096 vocabulary by default; or ``--model``) served twice per dtype:
by the native llama family, and forced through the transformers fallback
(``models/transformers.py``) by making the loader's family choice return it,
which it would for an architecture no native family registers. Each path's
ModelRunner is driven with engine plans by ``bench/decode_step.py``'s
``measure`` (decode steps of B sequences after a ``--context`` prefill) and
``measure_prefill`` (a new sequence's one ``--prefill``-token chunk). Columns:
median ``execute`` ms (the worker's whole step) of each path and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.decode_step import measure, measure_prefill  # noqa: E402
from jitney.worker.config import WorkerConfig  # noqa: E402
from jitney.worker.loading import loader  # noqa: E402
from jitney.worker.models import transformers as fallback  # noqa: E402
from jitney.worker.runner.model_runner import ModelRunner  # noqa: E402

PATHS = ("native", "transformers")


@contextmanager
def forced_fallback() -> Iterator[None]:
    """The loader picks the transformers fallback for every model while inside."""
    chosen = loader.family_for
    loader.family_for = lambda hf: fallback   # type: ignore[assignment]
    try:
        yield
    finally:
        loader.family_for = chosen   # type: ignore[assignment]


def build(path: str, dtype: str, through: str, prefill: int) -> ModelRunner:
    """A runner of the model on ``through`` ("native" or "transformers")."""
    config = WorkerConfig(model=path, dtype=dtype, block_size=16, num_blocks=1024,  # type: ignore[arg-type]
                          max_num_batched_tokens=max(1024, prefill), max_num_seqs=64, use_weights_cache=False)
    if through == "native":
        runner = ModelRunner(config)
    else:
        with forced_fallback():
            runner = ModelRunner(config)
    family = runner.model.config.family
    if (family == "transformers") != (through == "transformers"):
        raise SystemExit(f"the {through} runner was built by family {family!r}")
    return runner


def rows(args: argparse.Namespace, runner: ModelRunner) -> dict[str, float]:
    """Row label -> median execute seconds."""
    out = {f"decode {b}": measure(runner, b, args.context, args.reps)[1] for b in args.batch}
    if args.prefill:
        out[f"prefill {args.prefill}"] = measure_prefill(runner, args.prefill, args.reps)[1]
    return out


def random_llama(args: argparse.Namespace, folder: Path) -> str:
    from tests.support.tiny_models import make_tiny_llama

    return str(make_tiny_llama(folder / "llama", vocab_size=args.vocab, hidden_size=args.hidden,
                               num_layers=args.layers, num_heads=8, num_kv_heads=4,
                               max_position_embeddings=max(1024, 2 * args.prefill), seed=1))


def run(args: argparse.Namespace, model: str) -> list[str]:
    """The table's rows, printed as they come."""
    lines = []
    for dtype in args.dtype:
        got: dict[str, dict[str, float]] = {}
        for through in PATHS:
            runner = build(model, dtype, through, args.prefill)
            got[through] = rows(args, runner)
            del runner
        for label, native in got["native"].items():
            slow = got["transformers"][label]
            lines.append(f"| {dtype} | {label} | {native * 1000:.1f} | {slow * 1000:.1f} | {slow / native:.2f} |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prefill", type=int, default=512, help="0: no prefill row")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--model", default=None, help="a Llama folder instead of the random one")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| dtype | step | native ms | transformers ms | ratio |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run(args, args.model or random_llama(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
