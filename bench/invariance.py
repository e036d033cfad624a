#!/usr/bin/env python3
"""Batch invariance of a real server: each prompt alone, then the same prompts in a crowd.

The README promises that the same prompt and seed give the same output
whatever else is batched. This checks it as a user would see it, over gRPC:

    # starts `jitney serve` (default model, default flags), runs, stops it
    .venv/bin/python bench/invariance.py --prompts 6 --max-tokens 24 --batch 48 --inflight 32 --rounds 3

    # also seeded sampling (temperature 0.8, top_p 0.9, a fixed seed per prompt); results as JSON
    .venv/bin/python bench/invariance.py --prompts 6 --max-tokens 24 --batch 48 --inflight 32 --rounds 3 \\
        --seeded --json invariance.json

    # flags for the server it starts
    .venv/bin/python bench/invariance.py --serve-args "--dtype float32" --rounds 1

    # a server that is already running (started e.g. with `make serve`)
    .venv/bin/python bench/invariance.py --target 127.0.0.1:50051 --rounds 1

Step 1: every prompt is sent alone, one request at a time, greedy (and with
``--seeded`` also seeded), keeping its token ids and log-probs. Step 2:
``--rounds`` rounds, each sending ``--batch`` requests that cycle over those
(prompt, sampling) jobs in a shuffled order, at most ``--inflight`` at once.
Every output is compared with its alone run: token ids, and log-probs as
exact float values. Prompts are English text, tokenized by the server; every
request has ``ignore_eos`` so each output is exactly ``--max-tokens`` long.
The alone runs also fill the server's prefix cache, so the batched requests
usually start past their prompts' cached whole blocks (as later requests
would in production).

Prints a table (and writes ``--json``); exits 1 if any output differed.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.server_harness import running_server  # noqa: E402
from jitney.client.client import Sampling, make_params  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402
from jitney.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PROMPTS = [
    "The capital of France is",
    # Two prompts span several 16-token KV blocks: the alone runs cache them,
    # so the batched rounds start from prefix-cache hits.
    "Write a short poem about the sea. It should have four lines, mention the tide, the gulls and the "
    "wind, and end with a line about coming home after a long voyage across the grey northern water.",
    "Explain photosynthesis in one sentence.",
    "My favourite breakfast is",
    "Three tips for learning a new language:",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who repaired "
    "every clock in the valley, until one winter morning a stranger arrived carrying a clock that ran",
    "The difference between a list and a tuple in Python is",
    "Describe the color blue to someone who cannot see.",
    "A good name for a black cat would be",
    "The most important invention of the twentieth century was",
    "To make a cup of tea, first",
    "Why is the sky blue?",
]
TEMPERATURE, TOP_P, SEED_BASE = 0.8, 0.9, 1000
REQUEST_TIMEOUT = 600.0


@dataclass(frozen=True)
class Job:
    """One (prompt, sampling) pair: the unit that is run alone and then batched."""

    prompt_index: int
    prompt: str
    seeded: bool

    @property
    def name(self) -> str:
        return f"p{self.prompt_index}-{'seeded' if self.seeded else 'greedy'}"

    @property
    def sampling_name(self) -> str:
        return "seeded" if self.seeded else "greedy"

    def params(self, max_tokens: int) -> pb.GenerationParams:
        if self.seeded:
            sampling = Sampling(temperature=TEMPERATURE, top_p=TOP_P, seed=SEED_BASE + self.prompt_index,
                                max_tokens=max_tokens, ignore_eos=True)
        else:
            sampling = Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return make_params(self.prompt, sampling=sampling)


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    text: str
    cached_tokens: int


@dataclass
class Comparison:
    """One batched output against its job's alone run."""

    round: int
    job: str
    sampling: str
    tokens_differ: bool
    logprobs_differ: bool
    first_token_diff: int | None      # output index, None if the token ids are equal
    first_logprob_diff: int | None    # output index, None if the log-probs are equal
    max_logprob_delta: float          # largest |difference| while the token ids agree
    cached_tokens: int


@dataclass
class Row:
    round: int
    sampling: str
    requests: int = 0
    tokens_differ: int = 0
    logprobs_differ: int = 0
    max_logprob_delta: float = 0.0
    cached_tokens: int = 0
    seconds: float = 0.0


@dataclass
class Report:
    config: dict[str, Any]
    server: dict[str, Any]
    alone: dict[str, Generation]
    alone_seconds: float
    rows: list[Row] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.comparisons)

    @property
    def tokens_differ(self) -> int:
        return sum(c.tokens_differ for c in self.comparisons)

    @property
    def logprobs_differ(self) -> int:
        return sum(c.logprobs_differ for c in self.comparisons)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config, "server": self.server, "alone_seconds": self.alone_seconds,
            "alone": {name: asdict(g) for name, g in self.alone.items()},
            "requests": self.requests, "tokens_differ": self.tokens_differ,
            "logprobs_differ": self.logprobs_differ,
            "rows": [asdict(r) for r in self.rows], "comparisons": [asdict(c) for c in self.comparisons],
        }


def generate(stub: pb_grpc.GenerationServiceStub, params: pb.GenerationParams) -> Generation:
    """Stream one request to its end."""
    tokens: list[int] = []
    logprobs: list[float] = []
    text, cached = [], 0
    for msg in stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=REQUEST_TIMEOUT):
        tokens += msg.token_ids
        logprobs += msg.logprobs
        text.append(msg.text)
        if msg.HasField("usage"):
            cached = msg.usage.cached_prompt_tokens
    return Generation(tokens, logprobs, "".join(text), cached)


def compare(round_no: int, job: Job, alone: Generation, got: Generation) -> Comparison:
    first_token = next((k for k, (a, b) in enumerate(zip(alone.tokens, got.tokens)) if a != b), None)
    if first_token is None and len(alone.tokens) != len(got.tokens):
        first_token = min(len(alone.tokens), len(got.tokens))
    first_logprob = next((k for k, (a, b) in enumerate(zip(alone.logprobs, got.logprobs)) if a != b), None)
    if first_logprob is None and len(alone.logprobs) != len(got.logprobs):
        first_logprob = min(len(alone.logprobs), len(got.logprobs))
    agree = first_token if first_token is not None else len(alone.tokens)
    delta = max((abs(a - b) for a, b in zip(alone.logprobs[:agree], got.logprobs[:agree])), default=0.0)
    return Comparison(round_no, job.name, job.sampling_name, first_token is not None, first_logprob is not None,
                      first_token, first_logprob, delta, got.cached_tokens)


def run_invariance(stub: pb_grpc.GenerationServiceStub, *, prompts: Sequence[str], max_tokens: int, batch: int,
                   inflight: int, rounds: int, seeded: bool = False, shuffle_seed: int = 0,
                   log: Any = None) -> Report:
    """The experiment (see the module docstring) against the server behind ``stub``."""
    say = log or (lambda *_: None)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    server = {"model": info.model_name, "dtype": info.dtype, "device": info.device,
              "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens,
              "block_size": info.block_size}
    jobs = [Job(i, p, s) for s in ([False, True] if seeded else [False]) for i, p in enumerate(prompts)]
    config = {"prompts": list(prompts), "max_tokens": max_tokens, "batch": batch, "inflight": inflight,
              "rounds": rounds, "seeded": seeded, "shuffle_seed": shuffle_seed,
              "temperature": TEMPERATURE if seeded else None, "top_p": TOP_P if seeded else None}
    started = time.perf_counter()
    alone = {job.name: generate(stub, job.params(max_tokens)) for job in jobs}   # one at a time
    report = Report(config, server, alone, time.perf_counter() - started)
    say(f"alone: {len(jobs)} requests, one at a time, {report.alone_seconds:.1f} s")
    rng = random.Random(shuffle_seed)
    for round_no in range(1, rounds + 1):
        order = [jobs[i % len(jobs)] for i in range(batch)]
        rng.shuffle(order)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=inflight) as pool:
            outputs = list(pool.map(lambda job: generate(stub, job.params(max_tokens)), order))
        seconds = time.perf_counter() - started
        rows = {s: Row(round_no, s, seconds=seconds) for s in dict.fromkeys(j.sampling_name for j in jobs)}
        for job, got in zip(order, outputs):
            c = compare(round_no, job, alone[job.name], got)
            report.comparisons.append(c)
            row = rows[c.sampling]
            row.requests += 1
            row.tokens_differ += c.tokens_differ
            row.logprobs_differ += c.logprobs_differ
            row.max_logprob_delta = max(row.max_logprob_delta, c.max_logprob_delta)
            row.cached_tokens += c.cached_tokens
        report.rows += rows.values()
        say(f"round {round_no}: {batch} requests, at most {inflight} in flight, {seconds:.1f} s")
    return report


def format_table(report: Report) -> str:
    s, c = report.server, report.config
    lines = [
        f"{s['model']} ({s['dtype']} on {s['device']}, {s['max_num_seqs']} seats, "
        f"{s['max_num_batched_tokens']}-token steps, blocks of {s['block_size']})",
        f"{len(c['prompts'])} prompts x {'greedy + seeded' if c['seeded'] else 'greedy'}, "
        f"{c['max_tokens']} tokens each (alone, one at a time: {report.alone_seconds:.1f} s); "
        f"rounds of {c['batch']} requests, {c['inflight']} in flight",
        "",
        f"{'round':>5}  {'sampling':<8}  {'requests':>8}  {'token ids differ':>16}  {'logprobs differ':>15}  "
        f"{'max |dlogprob|':>14}  {'cached tok':>10}  {'seconds':>7}",
    ]
    for r in report.rows:
        lines.append(f"{r.round:>5}  {r.sampling:<8}  {r.requests:>8}  {r.tokens_differ:>16}  {r.logprobs_differ:>15}  "
                     f"{r.max_logprob_delta:>14.3g}  {r.cached_tokens:>10}  {r.seconds:>7.1f}")
    lines.append(f"{'all':>5}  {'':<8}  {report.requests:>8}  {report.tokens_differ:>16}  "
                 f"{report.logprobs_differ:>15}")
    lines.append("(max |dlogprob|: over the outputs' tokens before the first differing token id)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="HOST:PORT of a running server (default: start `jitney serve`)")
    parser.add_argument("--serve-args", default="", help="flags for the `jitney serve` this starts, one string")
    parser.add_argument("--prompts", type=int, default=6, help=f"how many prompts, 1..{len(PROMPTS)} (default 6)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per request (default 24)")
    parser.add_argument("--batch", type=int, default=48, help="requests per round (default 48)")
    parser.add_argument("--inflight", type=int, default=32, help="most requests in flight at once (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--seeded", action="store_true",
                        help=f"also seeded sampling: temperature {TEMPERATURE}, top_p {TOP_P}, seed {SEED_BASE}+prompt")
    parser.add_argument("--shuffle-seed", type=int, default=0, help="seed of the rounds' shuffles (default 0)")
    parser.add_argument("--json", type=Path, help="write the report (alone runs and every comparison) here")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    for name in ("max_tokens", "batch", "inflight", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    def say(*parts: object) -> None:
        print(*parts, file=sys.stderr, flush=True)

    with ExitStack() as stack:
        if args.target:
            channel = stack.enter_context(grpc.insecure_channel(args.target))
            stub = pb_grpc.GenerationServiceStub(channel)
        else:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jitney-invariance-")))
            say(f"starting jitney serve {args.serve_args}".rstrip())
            server = stack.enter_context(running_server(shlex.split(args.serve_args), logs))
            say(f"serving at {server.target}")
            stub = server.stub()
        report = run_invariance(stub, prompts=PROMPTS[: args.prompts], max_tokens=args.max_tokens,
                                batch=args.batch, inflight=args.inflight, rounds=args.rounds, seeded=args.seeded,
                                shuffle_seed=args.shuffle_seed, log=say)
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
        say(f"wrote {args.json}")
    return 1 if report.tokens_differ or report.logprobs_differ else 0


if __name__ == "__main__":
    sys.exit(main())
