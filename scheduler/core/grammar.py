"""Structured output: grammars compiled in the scheduler, token bitmasks per step.

A request's ResponseFormat (json_schema, json_object, regex, choice, EBNF
grammar) is compiled once per distinct format (``GrammarCompiler.compile``,
off the event loop, cached); each constrained sequence gets a
``GrammarMatcher``. Per step the scheduler fills the sequence's token bitmask
(``fill_batch`` for all constrained sequences of the step: ceil(vocab_size/32)
little-endian int32 words each, bit t%32 of word t//32 = token t allowed),
sends it in StepMasks, and feeds the sampled token back (``accept_token``).
EOS ids (the worker's ``Ready.eos_token_ids``) are allowed exactly where the
output is complete; once the grammar cannot go on, only EOS is.

Engine: llguidance (chosen over xgrammar by measurement)
--------------------------------------------------------
Measured with ``bench/grammar_engines.py`` (2 shared CPU cores, other jobs
running: absolute times are noisy, both engines ran in the same process one
after the other), SmolLM2-135M's tokenizer as Jitney loads it (49152 ids,
EOS 2), xgrammar 0.2.8 and llguidance 1.9.1:

    .venv/bin/pip install --target /tmp/gpkgs --no-deps xgrammar==0.2.8 \\
        apache-tvm-ffi==0.1.15.post2          # the other engine, outside the venv
    PYTHONPATH=/tmp/gpkgs .venv/bin/python bench/grammar_engines.py

                                          xgrammar 0.2.8     llguidance 1.9.1
  tokenizer index (once per process)      0.27 s             0.39-0.71 s
  compile ORDER_SCHEMA (nested objects,   2.4-3.6 s          1.3 ms
    arrays, enums, bounded ints, numbers,                    (+2.3 ms matcher
    patterned and length-bounded strings)                     and first mask)
  compile 60-property schema              188 ms             5 ms (+8 ms)
  json_object / regex / choice / EBNF     6 / 0.3 / 0.2 /    1.2 / 2.6 / 2.8 /
    (compile + first mask)                0.4 ms             3.8 ms
  mask fill, batch 32, per step           0.15-0.4 ms median 1.5-1.7 ms median
    (1-2 threads)                         16-19 ms p99       5-7 ms p99
  per sequence-token                      5-12 us            46-55 us
  accept, per token                       1.2-3 us           2-6 us
  tokens of 96 valid documents refused    991 of 9600        0 of 9600
  random walks of the schema that parse   18 of 24           24 of 24
    and validate (jsonschema)
  special tokens allowed as text          yes (by default)   never

Why llguidance:
  * Correctness on this vocabulary. xgrammar 0.2.8 refuses every JSON escape
    (\\", \\\\, \\t, \\u00e9) inside a string with minLength/maxLength, so valid
    documents are cut off; it lets raw control characters (\\x01) into such
    strings, so 6 of 24 sampled outputs were not JSON; and with this GGUF
    tokenizer ``TokenizerInfo.from_huggingface`` leaves <|endoftext|>,
    <repo_name>, ... as plain text allowed inside strings (the bench blanks
    them by hand to be fair). llguidance: no document token refused, every
    walk valid, special and padding ids never allowed.
  * Compile time. xgrammar's cost grows with string length bounds (a
    maxLength of 80 alone: ~1 s): a realistic schema took 2.4-3.6 s, and a
    hostile one is a cheap way to tie up the scheduler. llguidance compiles
    in milliseconds and builds its lexer lazily, each step's work bounded by
    its fuel limits (``LLParserLimits``), with clear errors when exceeded.
  * Dependencies. llguidance is one abi3 wheel with no Python dependencies;
    xgrammar requires torch, transformers, triton and apache-tvm-ffi (pins to
    watch against the project's torch).
  * The cost: masks are several times slower (about 1.5 ms a step for 32
    JSON sequences on one core, 5-7 ms p99). The scheduler computes masks
    while the worker's forward runs (44-91 ms for a batch of 32 on the CPU,
    docs/journal/2026-11-26-first-cpu-figures.md), so there it stays off the critical path. On a GPU
    (decode steps of 2-4 ms) it is of the order of a step: ``fill_batch``
    spreads rows over llguidance's threads, without the GIL, and only
    constrained sequences pay; measure it there before relying on it.

Behaviour worth knowing:
  * Where the grammar forces text (a required key, the rest of an enum
    value) llguidance's mask allows only the canonical tokens of it (after
    '{"' the token 'order', not 'o' or 'or'): stricter than necessary,
    always sound.
  * JSON, by default: compact (``COMPACT_JSON_OPTIONS``: ", " between items,
    ": " after a key, no other whitespace anywhere) and object schemas that do
    not set ``additionalProperties`` are closed (``close_objects``), as OpenAI's
    strict structured outputs and xgrammar's strict mode are. A small model
    given free whitespace and open objects wanders (newlines, repeated keys)
    until max_tokens; compact closed output is also the shortest. With
    ``ResponseFormat.lenient_json`` the schema keeps JSON Schema's own meaning
    (open objects) and at most ``MAX_JSON_WHITESPACE`` whitespace characters
    may come between two tokens (``LENIENT_JSON_OPTIONS``). Either way:
    \\uXXXX escapes allowed; property order follows the schema; llguidance
    rejects keywords it cannot enforce (e.g. an unknown "format") instead of
    ignoring them.
  * regex: Rust regex syntax, the whole output matches. grammar: GBNF
    (``root ::= ...``; Lark also accepted). choice: one of the strings.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Union

import llguidance
import numpy as np

from jitney.scheduler.core.admission import QueueFullError
from jitney.scheduler.core.request import InvalidRequestError
from jitney.scheduler.core.schema_closing import close_objects
from jitney.v1 import generation_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

FIELD = "params.response_format"

# Lenient JSON: between two JSON tokens (after "{", ",", ":" ...) at most this
# many whitespace characters: pretty-printed output stays possible (an indent
# of 4 at depth 15), a model that keeps emitting newlines is made to move on.
MAX_JSON_WHITESPACE = 64

# llguidance's JSON-schema compiler options. The default, compact: the
# separators of Python's json.dumps (", " and ": ") and no free whitespace, so
# the model has exactly one way to lay the document out.
COMPACT_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # "\u00e9" as well as "é" (Python's json.dumps writes the former); by
    # default llguidance allows \u escapes only for control characters.
    "json_allow_general_unicode_escapes": True,
}
# ResponseFormat.lenient_json: bounded free whitespace between tokens.
LENIENT_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}",
    "json_allow_general_unicode_escapes": True,
}

JSON_KINDS = frozenset({"json_schema", "json_object"})

# An engine message is the client's to read, but need not be a page long.
MAX_ERROR_CHARS = 1000

# (format kind, source text, lenient JSON): the cache key. The same schema
# compiles to different grammars compact-and-closed and lenient.
Key = tuple[str, str, bool]


__all__ = ["close_objects"]   # (re-exported: its home is schema_closing.py)


class GrammarCompilerBusyError(QueueFullError):
    """No compile can start now: every compile thread is taken (by compiles
    that ran past their time limit and still run, or by a full waiting line).
    A QueueFullError, so the server answers RESOURCE_EXHAUSTED."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """A zeroed (batch, words) little-endian int32 bitmask array."""
    return np.zeros((batch, bitmask_words(vocab_size)), dtype="<i4")


def _source(fmt: generation_pb2.ResponseFormat) -> tuple[Key, str]:
    """(cache key, field) of a ResponseFormat: the key's kind is its oneof field's name."""
    kind = fmt.WhichOneof("format")
    if kind is None:
        raise InvalidRequestError(FIELD, "no format is set (json_schema, json_object, regex, choice or grammar)")
    if fmt.lenient_json and kind not in JSON_KINDS:
        raise InvalidRequestError(f"{FIELD}.lenient_json", f"applies to json_schema and json_object only, "
                                                           f"not to {kind}")
    field = f"{FIELD}.{kind}"
    lenient = fmt.lenient_json
    if kind == "json_schema":
        try:
            json.loads(fmt.json_schema)
        except ValueError as exc:
            raise InvalidRequestError(field, f"not JSON: {exc}") from None
        return (kind, fmt.json_schema, lenient), field
    if kind == "json_object":
        if not fmt.json_object:
            raise InvalidRequestError(field, "must be true when set")
        return (kind, "", lenient), field
    if kind == "regex":
        return (kind, fmt.regex, False), field
    if kind == "choice":
        choices = list(fmt.choice.choices)
        if not choices:
            raise InvalidRequestError(f"{field}.choices", "must name at least one choice")
        return (kind, json.dumps(choices, ensure_ascii=False), False), f"{field}.choices"
    return (kind, fmt.grammar, False), field


def engine_grammar(fmt: generation_pb2.ResponseFormat) -> tuple[str, str]:
    """(llguidance grammar, field) of a ResponseFormat, as ``compile`` builds it: for a
    caller that puts it inside a grammar of its own (the answer after a reasoning block,
    scheduler/api/tools/grammar.py). Raises InvalidRequestError naming the field."""
    (kind, text, lenient), field = _source(fmt)
    try:
        return _engine_grammar(kind, text, lenient), field
    except ValueError as exc:
        raise InvalidRequestError(field, _message(str(exc))) from None


def _engine_grammar(kind: str, text: str, lenient: bool) -> str:
    """The llguidance grammar for a ResponseFormat's kind and text (may raise ValueError);
    kind "toplevel": ``text`` is already one (llguidance's TopLevelGrammar JSON)."""
    if kind == "toplevel":
        return text
    options = LENIENT_JSON_OPTIONS if lenient else COMPACT_JSON_OPTIONS
    if kind == "json_schema":
        schema = json.loads(text) if lenient else close_objects(json.loads(text))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "json_object":    # any object: open whatever the mode
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("lark" if kind == "lark" else "gbnf", text)   # GBNF (Lark accepted too)


def _message(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


class CompiledGrammar:
    """A compiled format: make one matcher per constrained sequence from it."""

    __slots__ = ("kind", "_proto", "_eos", "_vocab_size")

    def __init__(self, kind: str, proto: llguidance.LLMatcher, eos: frozenset[int], vocab_size: int) -> None:
        self.kind = kind                 # the ResponseFormat oneof field it came from
        self._proto = proto              # never advanced; matchers are copies of it
        self._eos = eos
        self._vocab_size = vocab_size

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the output (about a microsecond: the compiled grammar is shared)."""
        return GrammarMatcher(self._proto.deep_copy(), self._eos, self._vocab_size)


class GrammarMatcher:
    """One sequence's grammar state. Not thread-safe: one owner at a time.

    Per step: ``fill_bitmask`` (or ``fill_batch`` for many), the worker samples
    under the mask, then ``accept_token`` with the sampled id.
    """

    __slots__ = ("_m", "_eos", "_vocab_size", "_terminated")

    def __init__(self, m: llguidance.LLMatcher, eos: frozenset[int], vocab_size: int) -> None:
        self._m = m
        self._eos = eos
        self._vocab_size = vocab_size
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False: the token breaks the grammar (it was not
        in the mask); the matcher is then in an error state for good, and its mask allows
        only the EOS ids (so the sequence ends). An EOS id is accepted only where the
        output is complete, and terminates the matcher."""
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
        if self._terminated:
            return False
        ok = self._m.consume_token(token_id)
        if ok and token_id in self._eos:
            self._terminated = True
        return ok

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out``: ceil(vocab_size/32) int32 words,
        bit t % 32 of word t // 32 set where token t is allowed. EOS ids are allowed
        exactly where the output may end; ids past the tokenizer's vocabulary and its
        other special tokens never are."""
        _check_rows(out, 1, self._vocab_size, one_row=True)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def is_terminated(self) -> bool:
        """An EOS id was accepted: the output is complete and ended."""
        return self._terminated

    def is_completed(self) -> bool:
        """The output so far is a complete match: EOS is allowed now."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (complete and not extendable, or in error):
        the scheduler may end the sequence without sampling."""
        return self._m.is_stopped()

    def error(self) -> str:
        """Why the matcher is in its error state ('' when it is not)."""
        return self._m.get_error()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an accepted EOS counts)."""
        if num_tokens <= 0:
            return
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")
        self._terminated = False


def _check_rows(out: np.ndarray, rows: int, vocab_size: int, *, one_row: bool = False) -> None:
    words = bitmask_words(vocab_size)
    shape_ok = out.shape == (words,) if one_row else (out.ndim == 2 and out.shape[1] == words
                                                      and out.shape[0] >= rows)
    if not shape_ok:
        want = f"({words},)" if one_row else f"(>= {rows}, {words})"
        raise ValueError(f"bitmask shape {out.shape}, want {want} int32 words")
    if out.dtype != np.dtype("<i4") or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("bitmask must be a writeable, C-contiguous little-endian int32 array")


_executor: llguidance.LLExecutor | None = None


def _default_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()   # llguidance's default: 80% of the CPUs, at most 32
    return _executor


def only_token(row: np.ndarray) -> int | None:
    """The one token a mask row (int32 words) allows, or None where it allows none or several."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def forced_run(matcher: GrammarMatcher, first: int, limit: int, stops: frozenset[int],
               scratch: np.ndarray) -> list[int]:
    """Grammar jump-forward: ``first`` (the one token the matcher's mask allows now)
    and the tokens after it that are, each in turn, the only one the mask allows,
    ``limit`` at most, stopping before any of ``stops`` (EOS, stop ids: they end a
    sequence, which a sample decides). The matcher is left as it was. ``scratch``:
    one mask row. Each token costs one mask computation; a run is exact because a
    sampler given a one-token mask can only pick that token."""
    if first in stops or limit <= 0:
        return []
    run, accepted = [first], 0
    try:
        while len(run) < limit:
            if not matcher.accept_token(run[-1]):
                return []    # a token its own mask allowed: llguidance would be at fault
            accepted += 1
            if matcher.is_stopped():
                break
            matcher.fill_bitmask(scratch)
            token = only_token(scratch)
            if token is None or token in stops:
                break
            run.append(token)
    finally:
        matcher.rollback(accepted)
    return run


def fill_batch(matchers: Sequence[GrammarMatcher], out: np.ndarray,
               executor: llguidance.LLExecutor | None = None) -> None:
    """Row i of ``out`` (shape (>= len(matchers), words), int32) gets ``matchers[i]``'s
    mask; other rows are left as they are. The rows are computed in parallel on
    llguidance's thread pool (``executor``; a shared default one), without the GIL.
    It blocks for the whole batch (1.5-1.7 ms median for 32 JSON sequences on this
    2-core machine): call it from a thread (``asyncio.to_thread``) to keep the loop free."""
    if not matchers:
        return
    vocab = matchers[0]._vocab_size
    if any(m._vocab_size != vocab for m in matchers):
        raise ValueError("matchers of different vocabulary sizes in one batch")
    _check_rows(out, len(matchers), vocab)
    (executor or _default_executor()).unsafe_compute_mask_ptr(
        [(m._m, i) for i, m in enumerate(matchers)], out.ctypes.data, out.shape[1] * 4, out.shape[0])


class GrammarCompiler:
    """Compiles ResponseFormats for one model, off the event loop, with a cache.

    ``tokenizer``: the model's Hugging Face fast tokenizer (as the scheduler loads it),
    or an ``llguidance.LLTokenizer`` already made for the same ``vocab_size`` and EOS
    ids (``engine_tokenizer`` of another compiler). Building it from the HF tokenizer
    takes about 0.5 s, once.
    ``vocab_size``: the model's logits width; masks have ceil(vocab_size/32) words.
    Ids from the tokenizer's size up to it (padding of the model's head) are never
    allowed. It may not be smaller than the tokenizer.
    ``eos_token_ids``: the ids that end a constrained output (allowed exactly where it
    is complete); default the tokenizer's ``eos_token_id``. Pass the worker's
    ``Ready.eos_token_ids``.
    ``compile_timeout``: seconds one compile may run; past it the request gets
    InvalidRequestError ("too expensive to compile"). The compile goes on in its
    thread (a thread cannot be stopped) and its result is cached when it ends; while
    it runs, the same format is refused at once, and it holds one of ``max_workers``
    threads: when all of them are held so, new compiles are refused
    (GrammarCompilerBusyError) instead of queueing behind them. At most
    ``max_waiting`` compiles wait for a thread, each at most ``compile_timeout``.
    ``cache_size``: compiled formats (and formats found invalid) kept, least
    recently used dropped first.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, eos_token_ids: Sequence[int] | None = None,
                 compile_timeout: float = 10.0, max_workers: int = 1, max_waiting: int = 64,
                 cache_size: int = 256, limits: llguidance.LLParserLimits | None = None) -> None:
        if max_workers < 1 or max_waiting < 0 or cache_size < 0 or not compile_timeout > 0:
            raise ValueError("max_workers >= 1, max_waiting >= 0, cache_size >= 0, compile_timeout > 0")
        if isinstance(tokenizer, llguidance.LLTokenizer):
            engine_tok = tokenizer
            eos = list(eos_token_ids) if eos_token_ids is not None else list(tokenizer.eos_tokens)
            if engine_tok.vocab_size != vocab_size or set(engine_tok.eos_tokens) != set(eos):
                raise ValueError(f"the LLTokenizer has vocab_size {engine_tok.vocab_size} and EOS ids "
                                 f"{engine_tok.eos_tokens}; this compiler wants {vocab_size} and {eos}")
        else:
            if eos_token_ids is None:
                if tokenizer.eos_token_id is None:
                    raise ValueError("the tokenizer names no eos_token_id: pass eos_token_ids")
                eos_token_ids = [int(tokenizer.eos_token_id)]
            eos = [int(t) for t in eos_token_ids]
            if len(tokenizer) > vocab_size:
                raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} ids)")
            from llguidance import hf   # here: it imports transformers (and torch), which argument parsing needs not

            engine_tok = hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        if not eos or not all(0 <= t < vocab_size for t in eos):
            raise ValueError(f"EOS ids {eos} must be at least one id below vocab_size {vocab_size}")
        self.engine_tokenizer = engine_tok
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.compile_timeout = compile_timeout
        self.max_workers = max_workers
        self.max_waiting = max_waiting
        self._limits = limits
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._slots: asyncio.Semaphore | None = None      # made in the loop that first compiles
        self._waiting = 0
        self._cache_size = cache_size
        # key -> compiled grammar, or (field, message) of the InvalidRequestError it gave
        self._cache: OrderedDict[Key, Union[CompiledGrammar, tuple[str, str]]] = OrderedDict()
        self._running: dict[Key, asyncio.Future[CompiledGrammar]] = {}
        self._overdue: set[Key] = set()                    # running past compile_timeout

    async def compile(self, fmt: generation_pb2.ResponseFormat) -> CompiledGrammar:
        """The compiled grammar of ``fmt`` (from the cache when it was compiled before).

        Raises InvalidRequestError (field: params.response_format.<kind>, the engine's
        message) for a format that does not compile or took over ``compile_timeout``;
        GrammarCompilerBusyError when no compile thread can be had."""
        return await self._compile(*_source(fmt))

    async def compile_lark(self, text: str, field: str) -> CompiledGrammar:
        """A Lark grammar (scheduler/api/tools/grammar.py's), cached by its text; errors name ``field``."""
        return await self._compile(("lark", text, False), field)

    async def compile_toplevel(self, text: str, field: str) -> CompiledGrammar:
        """An llguidance TopLevelGrammar (JSON: grammars that refer to each other), cached
        by its text; errors name ``field``."""
        return await self._compile(("toplevel", text, False), field)

    async def _compile(self, key: Key, field: str) -> CompiledGrammar:
        hit = self._cached(key)
        if hit is not None:
            return hit
        running = self._running.get(key)
        if running is None:
            started = await self._start(key, field)
            if isinstance(started, CompiledGrammar):
                return started
            fut = started
        elif key in self._overdue:
            raise self._timeout_error(field)
        else:
            fut = running
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.compile_timeout)
        except asyncio.TimeoutError:
            if not fut.done():
                self._overdue.add(key)
            raise self._timeout_error(field) from None

    def cache_info(self) -> dict[str, int]:
        """Entries cached, compiles running, of them past their time limit."""
        return {"cached": len(self._cache), "running": len(self._running), "overdue": len(self._overdue)}

    def close(self) -> None:
        """Stop taking compiles; a running one ends in its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals --

    def _timeout_error(self, field: str) -> InvalidRequestError:
        return InvalidRequestError(field, f"too expensive to compile within {self.compile_timeout:g} s")

    def _cached(self, key: Key) -> CompiledGrammar | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        if isinstance(hit, tuple):
            raise InvalidRequestError(*hit)
        return hit

    def _store(self, key: Key, value: Union[CompiledGrammar, tuple[str, str]]) -> None:
        if self._cache_size == 0:
            return
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    async def _start(self, key: Key, field: str) -> asyncio.Future[CompiledGrammar] | CompiledGrammar:
        """Take a compile thread (waiting for one if need be) and start compiling ``key``."""
        if len(self._overdue) >= self.max_workers:
            raise GrammarCompilerBusyError(
                f"grammar compiler busy: all {self.max_workers} compile thread(s) are running compiles "
                f"that took over {self.compile_timeout:g} s; try again later")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_workers)
        if self._slots.locked():
            if self._waiting >= self.max_waiting:
                raise GrammarCompilerBusyError(
                    f"grammar compiler busy: {self._waiting} compiles are waiting for a thread")
            self._waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.compile_timeout)
            except asyncio.TimeoutError:
                raise GrammarCompilerBusyError(
                    f"grammar compiler busy: no compile thread was free within {self.compile_timeout:g} s"
                ) from None
            finally:
                self._waiting -= 1
        else:
            await self._slots.acquire()
        # While this waited, the same format may have been compiled or started.
        try:
            hit = self._cached(key)
        except InvalidRequestError:
            self._slots.release()
            raise
        running = self._running.get(key)
        if hit is not None or running is not None:
            self._slots.release()
            return hit if hit is not None else running  # type: ignore[return-value]
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._build, key, field)
        except RuntimeError:        # the pool was shut down (close())
            self._slots.release()
            raise
        self._running[key] = fut
        fut.add_done_callback(lambda f: self._finished(key, f))
        return fut

    def _finished(self, key: Key, fut: asyncio.Future[CompiledGrammar]) -> None:
        """In the loop, when a compile's thread is done (its waiters may have given up)."""
        assert self._slots is not None
        self._slots.release()
        self._running.pop(key, None)
        self._overdue.discard(key)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self._store(key, fut.result())
        elif isinstance(exc, InvalidRequestError):
            self._store(key, (exc.field, str(exc).removeprefix(exc.field + ": ")))

    def _build(self, key: Key, field: str) -> CompiledGrammar:
        """In a compile thread: the engine's grammar, a matcher on it and its first mask
        (llguidance builds its lexer lazily: the first mask is the rest of the compile)."""
        kind, text, lenient = key
        try:
            grammar = _engine_grammar(kind, text, lenient)
        except ValueError as exc:
            raise InvalidRequestError(field, _message(str(exc))) from None
        m = llguidance.LLMatcher(self.engine_tokenizer, grammar, log_level=0, limits=self._limits)
        if not m.is_error():
            m.compute_bitmask()
        if m.is_error():
            raise InvalidRequestError(field, _message(m.get_error()))
        return CompiledGrammar(kind, m, self.eos_token_ids, self.vocab_size)
