#!/usr/bin/env python3
"""The benchmark workloads of this folder, made again from their seeds.

    python bench/workloads/generate.py write [--out DIR] [NAME ...]
    python bench/workloads/generate.py random [--seed 0] [-n 64] [--rate 0] [--prompt-median 128]
        [--prompt-max 512] [--out-median 64] [--out-max 256] [--shared-prefix 0] [-o FILE]

``write`` writes the shipped files (default: all four, into this folder);
tests/bench/test_workloads.py checks that they come out byte for byte as shipped.
``random`` prints (or writes to ``-o``) a workload of random token ids with
other parameters.

One request a line: ``{"id", "arrival_s", "prompt_token_ids", "max_tokens"}``.
Random workloads draw every number from one seeded ``random.Random`` in a
fixed order (the shared prefix, then per request: the arrival gap, the
prompt length, the output length, the prompt's ids), so a seed gives the
same file on any machine and Python version. spec-edit-32 is real text
through the bundled model's tokenizer and chat template (loaded offline, from
the weights cache when it holds the converted tokenizer).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Prompt ids are drawn from [100, 49000): real vocabulary entries of the
# default model (49152 ids), clear of its special tokens at the bottom.
VOCAB_LO, VOCAB_HI = 100, 49000


@dataclass(frozen=True)
class RandomSpec:
    """A workload of random prompts with log-normal lengths: many short
    requests and a long tail, the traffic static batching handles worst."""

    seed: int
    n: int = 64
    rate: float = 0.0            # Poisson arrivals per second; 0 = all at t = 0
    prompt_median: int = 128
    prompt_max: int = 512
    out_median: int = 64
    out_max: int = 256
    shared_prefix: int = 0       # tokens every prompt starts with

    def requests(self) -> list[dict[str, Any]]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(self.shared_prefix)]
        arrival = 0.0
        rows = []
        for i in range(self.n):
            if self.rate > 0:
                arrival += rng.expovariate(self.rate)
            prompt_len = _lognormal_length(rng, self.prompt_median, 0.8, low=8, high=self.prompt_max)
            out_len = _lognormal_length(rng, self.out_median, 0.9, low=4, high=self.out_max)
            body = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(prompt_len)]
            rows.append({"id": f"r{i:04d}", "arrival_s": round(arrival, 4),
                         "prompt_token_ids": prefix + body, "max_tokens": out_len})
        return rows


def _lognormal_length(rng: random.Random, median: int, sigma: float, *, low: int, high: int) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


# spec-edit-32: passages a good answer mostly restates (prose, code, JSON,
# SQL, a list), each under four instructions, for speculative decoding.
SPEC_PASSAGES = (
    "The night bus leaves the central depot at eleven and follows the river road past the old mill, "
    "the hospital and the two schools before it turns north towards the university. Passengers can "
    "board at any marked stop, and the driver will also stop on request between the bridge and the "
    "market square.",

    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    total = 0.0\n"
    "    out = []\n"
    "    for i, v in enumerate(values):\n"
    "        total += v\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            out.append(total / window)\n"
    "    return out\n",

    '{"route": 42, "stops": ["Depot", "Mill Lane", "Hospital", "North School", "University"], '
    '"first_departure": "05:40", "last_departure": "23:10", "accessible": true, "fare_zone": 2}',

    "Ingredients: two cups of flour, one teaspoon of salt, three eggs, one cup of milk and a spoonful "
    "of butter. Mix the flour and salt, beat in the eggs, then add the milk slowly until the batter is "
    "smooth. Let it rest for half an hour before frying thin pancakes in the melted butter.",

    "SELECT stops.name, COUNT(trips.id) AS departures\n"
    "FROM stops\n"
    "JOIN trips ON trips.stop_id = stops.id\n"
    "WHERE trips.day = 'monday'\n"
    "GROUP BY stops.name\n"
    "ORDER BY departures DESC\n"
    "LIMIT 10;",

    "Meeting notes, Tuesday: the committee approved the winter timetable, agreed to add two evening "
    "runs on route 7, and asked the depot to report on the cost of heated shelters at the five busiest "
    "stops. The next meeting will review ticket prices and the new contactless readers.",

    "class Seat:\n"
    "    def __init__(self, number):\n"
    "        self.number = number\n"
    "        self.passenger = None\n"
    "\n"
    "    def board(self, name):\n"
    "        if self.passenger is not None:\n"
    "            raise RuntimeError('seat taken')\n"
    "        self.passenger = name\n"
    "\n"
    "    def alight(self):\n"
    "        self.passenger = None\n",

    "1. Check the tyre pressure every morning.\n"
    "2. Test the doors and the ramp before the first run.\n"
    "3. Record the mileage at the start and the end of each shift.\n"
    "4. Report any warning light to the depot at once.\n"
    "5. Clean the windscreen and the mirrors.",
)
SPEC_INSTRUCTIONS = (
    "Repeat the following text exactly, with no changes:",
    "Rewrite the following text exactly as it is, but in the same format, adding nothing:",
    "Here is some text. Copy it out in full, then stop.",
    "Proofread the following and return the complete text:",
)
# Past the passage's own length: a faithful copy ends before max_tokens, so
# with ignore_eos the last few tokens are free-running.
SPEC_EXTRA_TOKENS = 8


def spec_edit_requests(tokenizer: Any) -> list[dict[str, Any]]:
    """Every passage under every instruction, as one user turn of the chat
    template with the assistant turn opened (what the server's chat path sends)."""
    rows = []
    for p, passage in enumerate(SPEC_PASSAGES):
        max_tokens = len(tokenizer.encode(passage, add_special_tokens=False)) + SPEC_EXTRA_TOKENS
        for i, instruction in enumerate(SPEC_INSTRUCTIONS):
            messages = [{"role": "user", "content": f"{instruction}\n\n{passage}"}]
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out if isinstance(out, list) else out["input_ids"]   # transformers 5: a BatchEncoding
            rows.append({"id": f"spec-public-{p}-{i}", "arrival_s": 0.0,
                         "prompt_token_ids": [int(t) for t in ids], "max_tokens": max_tokens})
    return rows


def default_tokenizer() -> Any:
    """The bundled default model's tokenizer, as the server loads it."""
    sys.path.insert(0, str(HERE.parent.parent))   # run as a script from a checkout
    from jitney.common.model_files import cache_root, load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None), cache_root())


RANDOM_WORKLOADS = {
    "offline-64": RandomSpec(seed=7),
    # The same seed: its arrival gaps are drawn from the same stream, so its
    # requests differ from offline-64's.
    "online-64": RandomSpec(seed=7, rate=1.0),
    "prefix-64": RandomSpec(seed=11, prompt_median=64, prompt_max=256, out_median=32, out_max=128,
                            shared_prefix=384),
}
SHIPPED = (*RANDOM_WORKLOADS, "spec-edit-32")


def jsonl(rows: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def shipped_text(name: str, tokenizer: Callable[[], Any] = default_tokenizer) -> str:
    """The file ``name``.jsonl as it is shipped; ``tokenizer`` is only called for spec-edit-32."""
    if name in RANDOM_WORKLOADS:
        return jsonl(RANDOM_WORKLOADS[name].requests())
    if name == "spec-edit-32":
        return jsonl(spec_edit_requests(tokenizer()))
    raise ValueError(f"unknown workload {name!r}; shipped: {', '.join(SHIPPED)}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    write = sub.add_parser("write", help="write the shipped workloads")
    write.add_argument("names", nargs="*", metavar="NAME", help=f"which ({', '.join(SHIPPED)}; default all)")
    write.add_argument("--out", type=Path, default=HERE, help="folder (default: bench/workloads)")
    rand = sub.add_parser("random", help="print a random workload")
    defaults = RandomSpec(seed=0)
    rand.add_argument("--seed", type=int, default=defaults.seed)
    rand.add_argument("-n", type=int, default=defaults.n, help="requests")
    rand.add_argument("--rate", type=float, default=defaults.rate,
                      help="Poisson arrivals per second; 0 = all at once")
    for field in ("prompt_median", "prompt_max", "out_median", "out_max", "shared_prefix"):
        rand.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    rand.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode == "write":
        unknown = sorted(set(args.names) - set(SHIPPED))
        if unknown:
            _parser().error(f"unknown workload(s) {', '.join(unknown)}; shipped: {', '.join(SHIPPED)}")
        args.out.mkdir(parents=True, exist_ok=True)
        for name in args.names or SHIPPED:
            path = args.out / f"{name}.jsonl"
            path.write_text(shipped_text(name))
            print(path)
        return 0
    spec = RandomSpec(seed=args.seed, n=args.n, rate=args.rate, prompt_median=args.prompt_median,
                      prompt_max=args.prompt_max, out_median=args.out_median, out_max=args.out_max,
                      shared_prefix=args.shared_prefix)
    text = jsonl(spec.requests())
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
