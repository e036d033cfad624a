#!/usr/bin/env python3
"""Structured output: xgrammar and llguidance measured on this CPU, with the served tokenizer.

    .venv/bin/python bench/grammar_engines.py [--engines xgrammar llguidance] [--threads 1 2]
        [--steps 300] [--walks 24] [--repeats 5]

Both engines must be importable (the project installs only the chosen one; for
the comparison put the other on PYTHONPATH, e.g. ``pip install --target DIR
--no-deps xgrammar apache-tvm-ffi`` and ``PYTHONPATH=DIR``). An engine that is
missing is reported and skipped. ``jsonschema`` validates the random walks.

What is measured, per engine, with SmolLM2's tokenizer as Jitney loads it
(``jitney.common.model_files.load_tokenizer``) and the model's logits width:

compile
    ``tokenizer``: the engine's per-tokenizer index, built once per process.
    ``compile``: one fresh compile of ORDER_SCHEMA (nested objects, arrays,
    enums, integers with bounds, numbers, strings with patterns and lengths,
    optional and nullable fields), no cache; median of ``--repeats``.
    ``first mask``: a matcher on it and its first bitmask (an engine that
    builds its lexer lazily pays here). ``cold`` = tokenizer + compile + first
    mask, what the first request after start pays. Also LARGE_SCHEMA (60
    properties) and the other ResponseFormat kinds (json_object, regex,
    choice, EBNF).
mask at batch 32
    32 matchers, each driven along the tokenization of its own valid
    document (varied whitespace styles, non-ASCII text); when a document ends
    the slot starts the next one, so the batch stays 32 for ``--steps``
    steps. Per step the engine's batch API fills the (32, words) bitmask;
    the time of that fill is reported (median and p99 per step, and per
    sequence-token), then each matcher accepts its token (timed apart).
correctness
    Every document token must be allowed by the mask before it (violations
    counted), EOS must be allowed once a document is complete and refused
    before; ids past the tokenizer (the model's padding, if any) and special
    tokens other than EOS must never be allowed. The two engines' masks are
    compared position by position over the same documents (disagreements are
    listed). ``--walks`` random walks sample from the mask (biased toward
    structural tokens so that strings end) until EOS: each output must parse
    with ``json.loads`` and validate with ``jsonschema``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.common.model_files import load_tokenizer, resolve_model  # noqa: E402

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}$"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "phone": {"type": ["string", "null"], "pattern": "^\\+[0-9]{7,12}$"},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "maxLength": 12}},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "shipping": {
            "type": "object",
            "properties": {
                "address": {"type": "string", "maxLength": 60},
                "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "express": {"type": "boolean"},
            },
            "required": ["address", "country", "express"],
            "additionalProperties": False,
        },
        "total": {"type": "number", "minimum": 0},
        "notes": {"type": ["string", "null"], "maxLength": 80},
    },
    "required": ["order_id", "status", "customer", "items", "total"],
    "additionalProperties": False,
}

# The same kinds of fields, 60 of them: compile time as schemas grow.
LARGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        f"field_{i:02d}": [
            {"type": "string", "pattern": f"^[a-z]{{{1 + i % 5},{6 + i % 7}}}-[0-9]+$"},
            {"type": "integer", "minimum": -i, "maximum": 1000 + i},
            {"enum": [f"v{i}_{j}" for j in range(1 + i % 6)]},
            {"type": "array", "items": {"type": "number"}, "maxItems": 1 + i % 4},
            {"type": "object", "properties": {"x": {"type": "boolean"},
                                              "y": {"type": ["string", "null"], "maxLength": 10}},
             "required": ["x"], "additionalProperties": False},
        ][i % 5]
        for i in range(60)
    },
    "required": [f"field_{i:02d}" for i in range(0, 60, 2)],
    "additionalProperties": False,
}

OTHER_FORMATS: dict[str, tuple[str, str]] = {
    "json_object": ("json_schema", json.dumps({"type": "object"})),
    "regex": ("regex", r"(\+|-)?[0-9]{1,3}(\.[0-9]{2})? (USD|EUR|GBP)"),
    "choice": ("choice", json.dumps(["positive", "negative", "neutral"])),
    "ebnf": ("ebnf", 'root ::= item ("," item)*\nitem ::= [a-z]+ "=" [0-9]+'),
}

NAMES = ["Ada Lovelace", "Grace Hopper", "José Núñez", "Zoë Brontë", "Łukasz Żak", "山田太郎",
         "Ngozi Okonjo", "O'Brien \"Bob\"", "Anne\\Marie", "Émile Zola"]
TAGS = ["fragile", "gift", "bulk", "eco", "sale", "new", "北京", "x\ty"]


def make_document(rng: random.Random) -> dict[str, Any]:
    """A random document valid against ORDER_SCHEMA, keys in schema order."""
    customer: dict[str, Any] = {
        "name": rng.choice(NAMES),
        "email": f"{rng.choice(['ada', 'g.hopper', 'x_9'])}@{rng.choice(['example', 'mail'])}."
                 f"{rng.choice(['com', 'org', 'io'])}",
        "tier": rng.choice(["free", "pro", "enterprise"]),
    }
    if rng.random() < 0.5:
        customer["phone"] = None if rng.random() < 0.3 else "+" + str(rng.randrange(10**7, 10**12))
    items = []
    for _ in range(rng.randint(1, 4)):
        item: dict[str, Any] = {
            "sku": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
                   + f"-{rng.randrange(10000):04d}",
            "quantity": rng.randint(1, 100),
            "unit_price": rng.choice([0, 1, 9.99, 12.5, 1234.5678, 3e-3, 0.1]),
        }
        if rng.random() < 0.5:
            item["tags"] = rng.sample(TAGS, rng.randint(0, 3))
        items.append(item)
    doc: dict[str, Any] = {
        "order_id": f"ORD-{rng.randrange(10**6):06d}",
        "status": rng.choice(["pending", "paid", "shipped", "cancelled"]),
        "customer": customer,
        "items": items,
    }
    if rng.random() < 0.6:
        doc["shipping"] = {"address": rng.choice(["1 Main St", "Rue de l'Église 4", "Flat 2, 10 Downing St"]),
                           "country": rng.choice(["GB", "FR", "US", "JP"]),
                           "express": rng.random() < 0.5}
    doc["total"] = round(sum(i["quantity"] * i["unit_price"] for i in items), 2)
    if rng.random() < 0.5:
        doc["notes"] = None if rng.random() < 0.5 else rng.choice(["leave at door", "ring twice", "🙂 thanks"])
    return doc


def dump(doc: Any, style: int) -> str:
    """JSON text in one of four whitespace styles (compact, default, indent 2, indent 4 ASCII)."""
    if style == 0:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    if style == 1:
        return json.dumps(doc, ensure_ascii=False)
    if style == 2:
        return json.dumps(doc, indent=2, ensure_ascii=False)
    return json.dumps(doc, indent=4)


# -- engine adapters ---------------------------------------------------------------------------

@dataclass
class Engine:
    """One engine behind the bench's few operations."""

    name: str
    version: str
    build_tokenizer: Callable[[], Any]                       # -> engine tokenizer index
    compile: Callable[[Any, str, str], Any]                  # (index, kind, text) -> compiled; raises
    matcher: Callable[[Any, Any], Any]                       # (index, compiled) -> matcher
    fill: Callable[[Any, np.ndarray, int], None]             # (matcher, masks, row)
    make_batch_filler: Callable[[int], Callable[[list[Any], np.ndarray], None]]
    accept: Callable[[Any, int], bool]


def xgrammar_engine(tokenizer: Any, vocab_size: int, eos: list[int]) -> Engine:
    import xgrammar as xgr  # type: ignore[import-not-found, unused-ignore]
    from importlib.metadata import version

    def build() -> Any:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        # from_huggingface leaves this tokenizer's special tokens (<|endoftext|>,
        # <repo_name>, ...) as plain text, allowed inside strings: blank them (xgrammar's
        # mark of a special token) so that xgrammar is measured as it would be served.
        vocab = [""] * vocab_size
        for text, i in tokenizer.get_vocab().items():
            if i < vocab_size:
                vocab[i] = text
        for i in special_ids(tokenizer):
            vocab[i] = ""
        return xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=vocab_size, stop_token_ids=eos,
                                 add_prefix_space=info.add_prefix_space)

    def compile_(info: Any, kind: str, text: str) -> Any:
        c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(text)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(text)))
        return c.compile_grammar(text)

    def batch_filler(threads: int) -> Callable[[list[Any], np.ndarray], None]:
        b = xgr.BatchGrammarMatcher(max_threads=threads)
        return lambda ms, out: b.batch_fill_next_token_bitmask(ms, out)

    return Engine(
        "xgrammar", version("xgrammar"), build, compile_,
        lambda info, cg: xgr.GrammarMatcher(cg),
        lambda m, out, row: m.fill_next_token_bitmask(out, row),
        batch_filler,
        lambda m, t: bool(m.accept_token(t)),
    )


def llguidance_engine(tokenizer: Any, vocab_size: int, eos: list[int]) -> Engine:
    import llguidance as llg
    import llguidance.hf
    import llguidance.numpy as lln

    def build() -> Any:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    # The whitespace-flexible options (lenient_json): the documents come in four
    # whitespace styles, as xgrammar (any whitespace by default) gets them.
    from jitney.scheduler.core.grammar import LENIENT_JSON_OPTIONS

    def compile_(lt: Any, kind: str, text: str) -> Any:
        # Bounded whitespace, \\u escapes: what Jitney serves with lenient_json.
        grammar = (llg.LLMatcher.grammar_from_json_schema(text, overrides=LENIENT_JSON_OPTIONS)
                   if kind == "json_schema" else llg.grammar_from(kind, text))  # type: ignore[arg-type]
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lt)
        if is_error:
            raise ValueError(messages[0])
        return grammar

    def matcher(lt: Any, grammar: Any) -> Any:
        m = llg.LLMatcher(lt, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def batch_filler(threads: int) -> Callable[[list[Any], np.ndarray], None]:
        ex = llg.LLExecutor(num_threads=threads)
        return lambda ms, out: lln.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], out)

    return Engine(
        "llguidance", llg.__version__, build, compile_, matcher,
        lambda m, out, row: lln.fill_next_token_bitmask(m, out, row),
        batch_filler,
        lambda m, t: bool(m.consume_token(t)),
    )


def special_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's special tokens (EOS among them): never text."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    ids |= {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return sorted(ids)


ENGINES: dict[str, Callable[[Any, int, list[int]], Engine]] = {
    "xgrammar": xgrammar_engine, "llguidance": llguidance_engine}


# -- measurements ------------------------------------------------------------------------------

def allowed(masks: np.ndarray, row: int, token: int) -> bool:
    return bool((int(masks[row, token >> 5]) >> (token & 31)) & 1)


def allowed_ids(masks: np.ndarray, row: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(masks[row].view(np.uint8), bitorder="little"))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def __call__(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, flush=True)


@dataclass
class Setup:
    tokenizer: Any
    vocab_size: int          # the model's logits width
    eos: list[int]
    special: list[int]       # special ids that are not EOS
    words: int
    docs: list[list[int]]    # token ids of valid documents


def bench_compile(engine: Engine, setup: Setup, repeats: int, out: Report) -> Any:
    t0 = time.perf_counter()
    index = engine.build_tokenizer()
    t_tok = time.perf_counter() - t0
    masks = np.zeros((1, setup.words), dtype=np.int32)

    def compile_once(kind: str, text: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        compiled = engine.compile(index, kind, text)
        t1 = time.perf_counter()
        engine.fill(engine.matcher(index, compiled), masks, 0)
        return t1 - t0, time.perf_counter() - t1

    order = json.dumps(ORDER_SCHEMA)
    first = compile_once("json_schema", order)
    runs = [compile_once("json_schema", order) for _ in range(repeats)]
    c = statistics.median(r[0] for r in runs)
    f = statistics.median(r[1] for r in runs)
    out(f"  tokenizer index: {ms(t_tok)} (once per process)")
    out(f"  ORDER_SCHEMA: compile {ms(c)}, matcher + first mask {ms(f)} (median of {repeats});"
        f" first ever: {ms(first[0])} + {ms(first[1])}; cold total {ms(t_tok + first[0] + first[1])}")
    large = [compile_once("json_schema", json.dumps(LARGE_SCHEMA)) for _ in range(max(1, repeats // 2))]
    out(f"  LARGE_SCHEMA (60 properties): compile {ms(statistics.median(r[0] for r in large))},"
        f" matcher + first mask {ms(statistics.median(r[1] for r in large))}")
    parts = []
    for name, (kind, text) in OTHER_FORMATS.items():
        r = compile_once(kind, text)
        parts.append(f"{name} {ms(r[0] + r[1])}")
    out("  other formats (compile + first mask): " + ", ".join(parts))
    return index


def bench_batch(engine: Engine, setup: Setup, index: Any, threads: int, steps: int, batch: int,
                out: Report) -> dict[str, int]:
    """Mask time at batch ``batch`` and the per-token correctness counts."""
    compiled = engine.compile(index, "json_schema", json.dumps(ORDER_SCHEMA))
    fill = engine.make_batch_filler(threads)
    masks = np.zeros((batch, setup.words), dtype=np.int32)
    matchers = [engine.matcher(index, compiled) for _ in range(batch)]
    doc_of = list(range(batch))
    pos = [0] * batch
    next_doc = batch
    counts = {"tokens": 0, "refused_doc_token": 0, "eos_early": 0, "eos_missing_at_end": 0,
              "docs_done": 0, "accept_false": 0, "pad_or_special_allowed": 0}
    pad_and_special = np.array([*range(len(setup.tokenizer), setup.vocab_size), *setup.special],
                               dtype=np.int64)
    fill_t: list[float] = []
    accept_t: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(matchers, masks)
        fill_t.append(time.perf_counter() - t0)
        chosen = []
        for i in range(batch):
            doc = setup.docs[doc_of[i] % len(setup.docs)]
            done = pos[i] == len(doc)
            token = setup.eos[0] if done else doc[pos[i]]
            if not allowed(masks, i, token):
                counts["eos_missing_at_end" if done else "refused_doc_token"] += 1
            if not done and any(allowed(masks, i, e) for e in setup.eos):
                counts["eos_early"] += 1
            if pad_and_special.size and any(allowed(masks, i, int(t)) for t in pad_and_special):
                counts["pad_or_special_allowed"] += 1
            chosen.append(token)
        t0 = time.perf_counter()
        for i, token in enumerate(chosen):
            if not engine.accept(matchers[i], token):
                counts["accept_false"] += 1
        accept_t.append(time.perf_counter() - t0)
        for i, token in enumerate(chosen):
            counts["tokens"] += 1
            pos[i] += 1
            if token in setup.eos:        # the document and its EOS are done: next document
                counts["docs_done"] += 1
                doc_of[i], pos[i], next_doc = next_doc, 0, next_doc + 1
                matchers[i] = engine.matcher(index, compiled)
    fill_t.sort()
    med = statistics.median(fill_t)
    p99 = fill_t[min(len(fill_t) - 1, int(len(fill_t) * 0.99))]
    out(f"  batch {batch}, {threads} thread(s), {steps} steps: fill {ms(med)} median, {ms(p99)} p99 per step"
        f" = {med / batch * 1e6:.1f} us per sequence-token; accept {statistics.median(accept_t) / batch * 1e6:.1f}"
        f" us per token")
    return counts


def mask_diff(engines: list[Engine], indices: list[Any], setup: Setup, n_docs: int, out: Report) -> None:
    """Position-by-position agreement of two engines' masks along the same documents."""
    a, b = engines
    ca = a.compile(indices[0], "json_schema", json.dumps(ORDER_SCHEMA))
    cb = b.compile(indices[1], "json_schema", json.dumps(ORDER_SCHEMA))
    masks = np.zeros((2, setup.words), dtype=np.int32)
    positions = differ = 0
    one_way = {a.name: 0, b.name: 0}            # positions where only this engine allows something
    examples: dict[str, list[str]] = {a.name: [], b.name: []}
    for doc in setup.docs[:n_docs]:
        ma, mb = a.matcher(indices[0], ca), b.matcher(indices[1], cb)
        for k, token in enumerate([*doc, setup.eos[0]]):
            a.fill(ma, masks, 0)
            b.fill(mb, masks, 1)
            positions += 1
            if not np.array_equal(masks[0], masks[1]):
                differ += 1
                ids_a, ids_b = allowed_ids(masks, 0), allowed_ids(masks, 1)
                for engine, only in ((a, np.setdiff1d(ids_a, ids_b)), (b, np.setdiff1d(ids_b, ids_a))):
                    if only.size == 0:
                        continue
                    one_way[engine.name] += 1
                    if len(examples[engine.name]) < 4:
                        tail = setup.tokenizer.decode(doc[max(0, k - 6):k])
                        shown = [setup.tokenizer.decode([int(t)]) for t in only[:4]]
                        examples[engine.name].append(
                            f"    after ...{tail!r}: only {engine.name} allows {only.size}, e.g. {shown}")
            a.accept(ma, token)
            b.accept(mb, token)
    out(f"  masks differ at {differ} of {positions} positions ({n_docs} documents); "
        + ", ".join(f"{name} allows a token the other refuses at {n}" for name, n in one_way.items()))
    for lines in examples.values():
        for line in lines:
            out(line)


def random_walks(engine: Engine, setup: Setup, index: Any, schema: dict[str, Any], walks: int,
                 max_tokens: int, seed: int) -> tuple[int, int, int, list[str]]:
    """(ended with EOS, parsed, valid, failures) over ``walks`` biased random walks."""
    import jsonschema

    rng = np.random.default_rng(seed)
    compiled = engine.compile(index, "json_schema", json.dumps(schema))
    masks = np.zeros((1, setup.words), dtype=np.int32)
    ended = parsed = valid = 0
    failures: list[str] = []
    for _ in range(walks):
        m = engine.matcher(index, compiled)
        ids: list[int] = []
        for _ in range(max_tokens):
            engine.fill(m, masks, 0)
            token = sample(allowed_ids(masks, 0), setup, rng)
            if token < 0:
                failures.append("empty mask")
                break
            if not engine.accept(m, token):
                failures.append(f"mask allowed token {token} but accept refused it")
                break
            if token in setup.eos:
                ended += 1
                text = setup.tokenizer.decode(ids)
                try:
                    value = json.loads(text)
                except ValueError as exc:
                    failures.append(f"does not parse ({exc}): {text[:200]!r}")
                    break
                parsed += 1
                try:
                    jsonschema.validate(value, schema)
                    valid += 1
                except jsonschema.ValidationError as exc:
                    failures.append(f"invalid ({exc.message}): {text[:200]!r}")
                break
            ids.append(token)
    return ended, parsed, valid, failures


_STRUCTURAL: dict[int, bool] = {}


def sample(ids: np.ndarray, setup: Setup, rng: np.random.Generator) -> int:
    """One allowed id: EOS when allowed (half the time), else half the time one with
    punctuation in it (so that strings, numbers and whitespace runs end), else any."""
    if ids.size == 0:
        return -1
    eos = [e for e in setup.eos if np.any(ids == e)]
    if eos and rng.random() < 0.5:
        return eos[0]
    if rng.random() < 0.5:
        structural = [int(t) for t in ids if _is_structural(int(t), setup.tokenizer)] \
            if ids.size < 4096 else [int(t) for t in rng.choice(ids, 4096) if _is_structural(int(t), setup.tokenizer)]
        if structural:
            return int(rng.choice(structural))
    return int(rng.choice(ids))


def _is_structural(token: int, tokenizer: Any) -> bool:
    hit = _STRUCTURAL.get(token)
    if hit is None:
        text = tokenizer.decode([token])
        hit = _STRUCTURAL[token] = any(not (c.isalnum() or c.isspace()) for c in text)
    return hit


WALK_SCHEMAS: dict[str, dict[str, Any]] = {
    "ORDER_SCHEMA": ORDER_SCHEMA,
    "json_object": {"type": "object"},
    "array of enums/ints": {"type": "array", "items": {"anyOf": [{"enum": ["a", "b", 3]},
                                                              {"type": "integer", "minimum": -5}]},
                            "minItems": 2, "maxItems": 6},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--docs", type=int, default=96, help="valid documents to drive the matchers with")
    parser.add_argument("--walks", type=int, default=24, help="random walks per walk schema")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="tokenizer of this model (default: the bundled SmolLM2)")
    args = parser.parse_args()
    out = Report()

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab_size = len(tokenizer)   # SmolLM2's logits width equals its tokenizer's size (49152)
    eos = [int(tokenizer.eos_token_id)]
    special = [t for t in special_ids(tokenizer) if t not in eos]
    rng = random.Random(0)
    texts = [dump(make_document(rng), i % 4) for i in range(args.docs)]
    docs = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    setup = Setup(tokenizer, vocab_size, eos, special, (vocab_size + 31) // 32, docs)
    out(f"tokenizer: {type(tokenizer).__name__}, {len(tokenizer)} ids, eos {eos}, other special {special};"
        f" loaded in {time.perf_counter() - t0:.1f} s; {len(docs)} documents,"
        f" {sum(map(len, docs))} tokens ({min(map(len, docs))}..{max(map(len, docs))} each)")

    engines: list[Engine] = []
    indices: list[Any] = []
    for name in args.engines:
        try:
            engine = ENGINES[name](tokenizer, vocab_size, eos)
        except ImportError as exc:
            out(f"\n{name}: not installed ({exc}); skipped")
            continue
        out(f"\n{engine.name} {engine.version}")
        index = bench_compile(engine, setup, args.repeats, out)
        for threads in args.threads:
            counts = bench_batch(engine, setup, index, threads, args.steps, args.batch, out)
        out("  correctness along documents: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        for title, schema in WALK_SCHEMAS.items():
            ended, parsed, valid, failures = random_walks(engine, setup, index, schema, args.walks, 600, 1)
            out(f"  random walks, {title}: {ended}/{args.walks} ended with EOS, {parsed} parse, {valid} valid")
            for f in failures[:3]:
                out(f"    {f}")
        engines.append(engine)
        indices.append(index)
    if len(engines) == 2:
        out(f"\nmask agreement, {engines[0].name} vs {engines[1].name}:")
        mask_diff(engines, indices, setup, 8, out)
    out("\nThe choice, as scheduler/core/grammar.py records it:")
    out(decision())
    return 0


def decision() -> str:
    """The engine section of scheduler/core/grammar.py's docstring (numbers and reasons)."""
    import jitney.scheduler.core.grammar as grammar

    doc = grammar.__doc__ or ""
    return doc[doc.find("Engine:"):].rstrip()


if __name__ == "__main__":
    raise SystemExit(main())
