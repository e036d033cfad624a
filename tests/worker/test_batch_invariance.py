"""Batch invariance: a request's tokens and log-probs do not depend on what else runs.

The README promises that the same prompt and seed give the same output
whatever else is batched. Here every request is first run alone (one
sequence, its whole prompt in one chunk: the reference), then the same
requests run through ``tests.support.invariance_driver.BatchDriver`` (a scheduler
that writes the worker's step plans itself) in batches of 2 to 48
sequences, with chunk budgets from 1 to 512 tokens, preemption and resume
(recompute from position 0 in new blocks) and prefix-cache hits (a first
chunk starting at a block boundary, on another sequence's blocks). Token ids
and log-probs must be bit-identical to the reference (``==`` on the floats),
in float32 and in bfloat16, on two model shapes. The last test runs
``bench/invariance.py``'s experiment against a real server on the default
model and dtype.

The runners use one intra-op thread (``THREADS``): a tiny model's step is
mostly thread hand-offs, 5-10x slower with two threads on a 2-core machine
(30x while another process is busy). The server test runs with torch's
default thread count. The thread count is restored after each run.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.invariance import PROMPTS as TEXT_PROMPTS
from bench.invariance import format_table, run_invariance
from tests.support.invariance_driver import (
    BatchDriver, Output, PreemptPolicy, Request, first_difference, preempt_by_position, run_alone, torch_threads,
)
from tests.support.server_harness import Server
from tests.support.tiny_models import make_tiny_llama
from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.config import DType, WorkerConfig
from jitney.worker.runner.model_runner import ModelRunner

# name -> (make_tiny_llama arguments, KV block size)
SHAPES: dict[str, tuple[dict[str, Any], int]] = {
    "tiny": ({}, 4),                                                     # hidden 64, 4 heads (2 KV)
    "wide": ({"hidden_size": 256, "num_heads": 8, "num_kv_heads": 4}, 16),  # head_dim 32
}
# Shapes run with quantized weights (--quantization), outside SHAPES' loops: their own test below.
QUANTIZED: dict[str, str] = {"tiny-int8": "int8", "wide-int8": "int8", "wide-int4": "int4"}
QUANTIZED_SHAPES: dict[str, tuple[dict[str, Any], int]] = {name: SHAPES[name.split("-")[0]] for name in QUANTIZED}
DTYPES: list[DType] = ["bfloat16", "float32"]
REF_TOKENS = 8            # the alone runs' length; batched requests ask for at most this many
THREADS = 1

SHARED = tuple(range(100, 116))    # 16 tokens: 4 blocks of 4, 1 block of 16
PROMPTS: list[tuple[int, ...]] = [
    (5,),                                      # one token: its prefill looks like a decode
    (300, 2, 19),
    (23, 24, 25, 26, 27, 28, 29),
    SHARED + (4,),                             # SHARED's whole blocks come from the cache
    SHARED + (77, 140, 141, 142, 143, 9),
    SHARED,                                    # all whole blocks: the hit stops one block short
    SHARED[:8] + (33, 34, 35),                 # two blocks of 4 shared, none of 16
    tuple(range(30, 53)),
    tuple((7 * i) % 311 + 3 for i in range(45)),
    tuple((13 * i) % 301 + 5 for i in range(70)),  # several chunks even at a 64-token budget
]


def mixed_requests(n: int, max_tokens: int | None = None) -> list[Request]:
    """``n`` requests cycling over the prompts, every other one seeded (T 0.8,
    top_p 0.9, its own seed; each prompt both ways every two cycles), 3..8
    tokens unless given."""
    out = []
    for j in range(n):
        prompt = PROMPTS[j % len(PROMPTS)]
        tokens = max_tokens or 3 + (7 * j) % 6
        if (j + j // len(PROMPTS)) % 2:
            out.append(Request(prompt, tokens, temperature=0.8, top_p=0.9, seed=1000 + j))
        else:
            out.append(Request(prompt, tokens))
    return out


class References:
    """Each request run alone on its (shape, dtype, threads) runner, computed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, Path] = {}
        self.runners: dict[tuple[str, str, int], ModelRunner] = {}
        self.outputs: dict[tuple[str, str, int, Request], Output] = {}

    def config(self, shape: str, dtype: DType) -> WorkerConfig:
        kwargs, block_size = {**SHAPES, **QUANTIZED_SHAPES}[shape]
        if shape not in self.models:
            self.models[shape] = make_tiny_llama(self.root / shape, **kwargs)
        return WorkerConfig(model=str(self.models[shape]), dtype=dtype, block_size=block_size,
                            num_blocks=1024, max_num_batched_tokens=512, max_num_seqs=64,
                            quantization=QUANTIZED.get(shape, "none"))

    def runner(self, shape: str, dtype: DType) -> ModelRunner:
        """A fresh runner for a batched run (the references keep their own)."""
        return ModelRunner(self.config(shape, dtype))

    def alone(self, shape: str, dtype: DType, request: Request, threads: int = THREADS) -> Output:
        key = (shape, dtype, threads, replace(request, max_tokens=REF_TOKENS))
        if key not in self.outputs:
            with torch_threads(threads):
                if key[:3] not in self.runners:
                    self.runners[key[:3]] = self.runner(shape, dtype)
                self.outputs[key] = run_alone(self.runners[key[:3]], key[3])
        return self.outputs[key]

    def batched(self, shape: str, dtype: DType, budget: int, arrivals: Mapping[int, Sequence[tuple[int, Request]]],
                preempt: PreemptPolicy | None = None, threads: int = THREADS) -> tuple[BatchDriver, dict[int, Output]]:
        """A fresh runner driven by a ``BatchDriver`` through ``arrivals``."""
        with torch_threads(threads):
            driver = BatchDriver(self.runner(shape, dtype), budget=budget)
            return driver, driver.run(arrivals, preempt=preempt)


@pytest.fixture(scope="module")
def refs() -> Iterator[References]:
    # Not tmp_path_factory: the hypothesis test shares this module fixture.
    with tempfile.TemporaryDirectory(prefix="invariance-") as tmp:
        yield References(Path(tmp))


def check_against_alone(refs: References, shape: str, dtype: DType, outputs: Mapping[int, Output],
                        label: str, threads: int = THREADS) -> None:
    """Every output bit-identical to its alone run, else one line per differing
    request (those with other token ids first)."""
    lines: list[tuple[bool, int, str]] = []
    max_delta = 0.0
    for rid, got in sorted(outputs.items()):
        ref = refs.alone(shape, dtype, got.request, threads)
        want = replace(ref, samples=ref.samples[: got.request.max_tokens])
        diff = first_difference(want, got)
        if diff is None:
            continue
        for a, b in zip(want.samples, got.samples):
            if a.token != b.token:
                break
            max_delta = max(max_delta, abs(a.logprob - b.logprob))
        lines.append((want.tokens == got.tokens, rid,
                      f"  request {rid} ({got.request.describe()}; cached {got.cached_tokens} tokens, "
                      f"preempted after {got.preempted_after} outputs): {diff}"))
    if lines:
        token_diffs = sum(not same for same, _, _ in lines)
        head = (f"{label}: {len(lines)} of {len(outputs)} requests differ from their alone run "
                f"({token_diffs} in token ids, {len(lines) - token_diffs} in log-probs only; largest "
                f"|logprob difference| before a token differs {max_delta:.3g}):")
        shown = [line for _, _, line in sorted(lines)[:12]]
        pytest.fail("\n".join([head, *shown, *(["  ..."] if len(lines) > 12 else [])]), pytrace=False)


def waves(requests: Sequence[Request], at: Mapping[int, range]) -> dict[int, list[tuple[int, Request]]]:
    return {step: [(rid, requests[rid]) for rid in rids] for step, rids in at.items()}


def two_preemptions(driver: BatchDriver) -> list[int]:
    """Before step 6: the running request with the most outputs; before step 13:
    one in the middle of its prefill if any (else the last to board)."""
    running = driver.running
    if driver.step_index == 6 and running:
        return [max(running, key=lambda s: len(s.output.samples)).rid]
    if driver.step_index == 13 and running:
        mid = [s for s in running if 0 < s.computed < len(s.tokens) - 1]
        return [(mid or running)[-1].rid]
    return []


# ---- continuous batching: chunked prefill, preemption, prefix-cache hits ----

WAVES = {0: range(0, 1), 2: range(1, 3), 5: range(3, 10), 9: range(10, 48)}


@pytest.mark.parametrize("budget", [7, 16, 64, 512])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_continuous_batching_matches_alone(refs: References, dtype: DType, shape: str, budget: int) -> None:
    """48 requests in waves of 1, 2, 7 and 38 (the batch grows from one
    sequence to as many as the budget holds, then drains), prompts cut into
    chunks by the budget, two preemptions, prefix-cache hits."""
    requests = mixed_requests(48)
    driver, outputs = refs.batched(shape, dtype, budget, waves(requests, WAVES), two_preemptions)
    # The schedule is what this test claims (it depends on lengths only, not on the numbers).
    assert all(len(o.samples) == o.request.max_tokens for o in outputs.values())
    assert any(n > 0 for o in outputs.values() for n in o.preempted_after), "no preemption after outputs"
    assert sum(len(o.preempted_after) for o in outputs.values()) == 2
    assert sum(bool(o.cached_tokens) for o in outputs.values()) >= 4, "too few prefix-cache hits"
    sizes = [s.seqs for s in driver.steps]
    assert min(sizes) == 1 and max(sizes) >= min(budget // 2, 24), sizes
    assert all(s.tokens <= budget for s in driver.steps)
    if budget < 70:
        assert any(o.prefill_chunks > 1 for o in outputs.values() if not o.preempted_after), "no chunked prompt"
    check_against_alone(refs, shape, dtype, outputs, f"{dtype} {shape}, budget {budget}")


@pytest.mark.parametrize("size", [2, 5, 16, 48])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_of_n_matches_alone(refs: References, dtype: DType, shape: str, size: int) -> None:
    """``size`` requests at once, 8 tokens each: decode steps of exactly ``size`` sequences."""
    requests = mixed_requests(size, max_tokens=REF_TOKENS)
    driver, outputs = refs.batched(shape, dtype, 512, waves(requests, {0: range(size)}))
    assert max(s.decodes for s in driver.steps) == size
    check_against_alone(refs, shape, dtype, outputs, f"{dtype} {shape}, {size} at once")


@pytest.mark.parametrize("shape", sorted(QUANTIZED_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_weights_keep_batch_invariance(refs: References, dtype: DType, shape: str) -> None:
    """--quantization int8 and int4: continuous batching with chunked prompts, two
    preemptions and prefix-cache hits gives every request its alone run's bits."""
    runner = refs.runner(shape, dtype)
    assert runner.ready_message().quantization == QUANTIZED[shape]
    assert not any(isinstance(m, torch.nn.Linear) for m in runner.model.modules())
    layer = cpu_kernels.Int4Linear if QUANTIZED[shape] == "int4" else cpu_kernels.Int8Linear
    assert sum(isinstance(m, layer) for m in runner.model.modules()) > 0
    assert isinstance(runner.model.lm_head, cpu_kernels.Int8Linear)
    requests = mixed_requests(48)
    _, outputs = refs.batched(shape, dtype, 16, waves(requests, WAVES), two_preemptions)
    assert all(len(o.samples) == o.request.max_tokens for o in outputs.values())
    check_against_alone(refs, shape, dtype, outputs, f"{dtype} {shape}, budget 16")


def test_the_same_schedule_twice_is_bit_identical(refs: References) -> None:
    """Run-to-run determinism (holds today): what the tests above find comes from
    the batch's composition, not from noise."""
    at = waves(mixed_requests(24), {0: range(0, 4), 3: range(4, 24)})
    runs = [refs.batched("tiny", "bfloat16", 16, at, two_preemptions)[1] for _ in range(2)]
    assert [(o.tokens, o.logprobs) for o in runs[0].values()] == [(o.tokens, o.logprobs) for o in runs[1].values()]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_driver_computes_what_the_alone_run_computes(refs: References, shape: str) -> None:
    """A check on the driver itself that holds whatever the kernels' summation
    order: in float32 every batched token equals the alone run's and every
    log-prob is within rounding (a wrong position, block or token in a plan
    would be far off). Chunks, preemption and prefix hits included."""
    _, outputs = refs.batched(shape, "float32", 16, waves(mixed_requests(48), WAVES), two_preemptions)
    for rid, got in outputs.items():
        ref = refs.alone(shape, "float32", got.request)
        assert got.tokens == ref.tokens[: len(got.tokens)], (rid, got.request.describe())
        for k, (a, b) in enumerate(zip(ref.samples, got.samples)):
            assert math.isclose(a.logprob, b.logprob, rel_tol=1e-4, abs_tol=1e-4), (rid, k, a, b)


# ---- any composition ---------------------------------------------------------

PROMPT_INDEX = st.integers(0, len(PROMPTS) - 1)
SEEDS = st.sampled_from([0, 7, 1234, 2**63 + 5])


@st.composite
def compositions(draw: st.DrawFn) -> tuple[list[tuple[int, Request]], int, dict[int, list[int]]]:
    """Requests with their arrival steps (in submission order), a budget, and
    (step -> positions among the running) preemptions."""
    arrivals = []
    for _ in range(draw(st.integers(1, 12))):
        prompt = PROMPTS[draw(PROMPT_INDEX)]
        max_tokens = draw(st.integers(1, REF_TOKENS))
        if draw(st.booleans()):
            request = Request(prompt, max_tokens, temperature=0.8, top_p=0.9, seed=draw(SEEDS))
        else:
            request = Request(prompt, max_tokens)
        arrivals.append((draw(st.integers(0, 12)), request))
    budget = draw(st.sampled_from([1, 2, 3, 5, 7, 16, 33, 64, 512]))
    preempts = draw(st.dictionaries(st.integers(0, 40), st.lists(st.integers(0, 11), min_size=1, max_size=2),
                                    max_size=3))
    return arrivals, budget, preempts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          # No shrinking: each example runs the model, and the message below names
          # the whole schedule anyway.
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(composition=compositions())
def test_any_composition_matches_alone_bf16(
        refs: References, composition: tuple[list[tuple[int, Request]], int, dict[int, list[int]]]) -> None:
    arrivals, budget, preempts = composition
    at: dict[int, list[tuple[int, Request]]] = {}
    for rid, (step, request) in enumerate(arrivals):
        at.setdefault(step, []).append((rid, request))
    driver, outputs = refs.batched("tiny", "bfloat16", budget, at, preempt_by_position(preempts))
    label = (f"bf16 tiny, budget {budget}, arrivals {sorted((s, r) for r, (s, _) in enumerate(arrivals))}, "
             f"preempt (step: running positions) {preempts}, {len(driver.steps)} steps, "
             f"largest step {max(s.seqs for s in driver.steps)} seqs")
    check_against_alone(refs, "tiny", "bfloat16", outputs, label)


# ---- a real server, the default model and dtype ------------------------------


@pytest.mark.slow
def test_the_default_server_is_batch_invariant(default_server: Server) -> None:
    """``bench/invariance.py``'s experiment on `jitney serve` with no flags (the
    bundled default model, its default dtype): 6 prompts alone, greedy and
    seeded, then one round of 48 requests over them, 32 in flight."""
    report = run_invariance(default_server.stub(), prompts=TEXT_PROMPTS[:6], max_tokens=24, batch=48,
                            inflight=32, rounds=1, seeded=True)
    table = format_table(report)
    print("\n" + table)
    assert report.requests == 48
    assert (report.tokens_differ, report.logprobs_differ) == (0, 0), (
        f"{report.tokens_differ} outputs with other token ids and {report.logprobs_differ} with other "
        f"log-probs than alone:\n{table}")
