"""The worker's sampling parameters beyond temperature / top-p / top-k, on fixed logits.

Each logits processor against a reference (transformers' processors and
warpers where they exist, by hand otherwise); batch invariance of mixed
batches; plan validation. Through the runner and the worker's ZeroMQ loop:
test_sampling_params_runner.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.runner.input_batch import InputBatch, StepChunk
from jitney.worker.runner.plan_checks import PlanError, PlanLimits, ProcessorParams, SequenceState, validate_plan
from jitney.worker.runner.sampler import (SamplingBatch, apply_penalties, mask_logits, mask_logits_, sample,
                                          sample_step, top_tokens)
from tests.support.sampling_refs import VOCAB, bitmask, ref_penalties

CPU = torch.device("cpu")
NEG_INF = float("-inf")


# -- references --------------------------------------------------------------

def ref_allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmask words (M, W) int32 -> allowed (M, vocab), by numpy's little-endian unpacking."""
    return np.unpackbits(words.astype("<i4").view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)


def logits_for(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# -- sampler-level: each processor vs its reference ------------------------------

def test_penalties_match_transformers_and_hand_reference() -> None:
    logits = logits_for(3)
    prompt = [[5, 6, 7, 7], [10, 11], [1]]
    output = [[7, 8, 8, 8, 9], [], [12, 12, 300]]
    rep, presence, frequency = [1.3, 0.7, 1.0], [0.5, 0.0, -1.5], [0.2, 1.0, 0.75]
    counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.int64), minlength=VOCAB) for o in output])
    seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    for i, p in enumerate(prompt):
        seen[i, p] = True
    got = apply_penalties(logits, counts.int(), seen, torch.tensor(rep), torch.tensor(presence),
                          torch.tensor(frequency))
    want = ref_penalties(logits, prompt, output, rep, presence, frequency)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def batch_with(params: list[ProcessorParams], histories: list[list[int]],
               temperature: list[float] | None = None) -> tuple[InputBatch, object]:
    """An InputBatch holding one row per ``params``; each row's history computed in one chunk
    (so its penalty counts are built from the staging), every row sampling after it."""
    batch = InputBatch(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=64, block_size=4, device=CPU,
                       vocab_size=VOCAB)
    temps = temperature or [0.0] * len(params)
    for sid, (p, t) in enumerate(zip(params, temps)):
        batch.add(sid, t, 1.0, 0, seed=sid, params=p)
    step = batch.stage([StepChunk(sid, 0, h, True, sid) for sid, h in enumerate(histories)])
    return batch, step


def test_processors_built_by_the_batch_match_the_references() -> None:
    """Counts from the staged chunks, bias, min_tokens bans and masks, against transformers / by hand."""
    histories = [[5, 6, 7, 8, 8, 9, 7], [10, 11, 12, 2, 13], [20, 21, 22, 23], [30, 31]]
    npt = [4, 3, 2, 2]
    params = [
        ProcessorParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4, num_prompt_tokens=4),
        ProcessorParams(logit_bias_ids=(3, 50, 319), logit_bias_values=(2.5, -7.0, 1.0), num_prompt_tokens=3),
        # min_tokens 3: 2 generated (positions 2, 3), the one sampled at 4 is the third: banned.
        ProcessorParams(min_tokens=3, min_tokens_banned_ids=(2, 40), num_prompt_tokens=2),
        # Reached: position 2 - 2 = 0 generated, min_tokens 0 -> no ban.
        ProcessorParams(min_tokens=0, min_tokens_banned_ids=(2,), num_prompt_tokens=2),
    ]
    batch, step = batch_with(params, histories)
    logits = logits_for(4)
    words = bitmask([list(range(0, 100)), list(range(30, 60)) + [2]])
    processed = batch.processors(step, (np.array([1, 3]), words)).apply(logits)

    want = logits.clone()
    want[0:1] = ref_penalties(logits[0:1], [histories[0][:4]], [histories[0][4:]], [1.5], [0.3], [0.4])
    for t, b in zip((3, 50, 319), (2.5, -7.0, 1.0)):
        want[1, t] += b
    ban = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=[2, 40])
    want[2:3] = ban(torch.tensor([histories[2]]), want[2:3])
    allowed = torch.from_numpy(ref_allowed(words, VOCAB))
    want[[1, 3]] = want[[1, 3]].masked_fill(~allowed, NEG_INF)
    torch.testing.assert_close(processed, want, rtol=0, atol=0)
    # The counts behind row 0: the output part of its history, and its prompt.
    row = batch.rows[0]
    assert batch.counts.output is not None and batch.counts.prompt is not None
    assert batch.counts.output[row].tolist() == torch.bincount(torch.tensor([8, 9, 7]), minlength=VOCAB).tolist()
    assert batch.counts.prompt[row].nonzero().squeeze(-1).tolist() == [5, 6, 7, 8]


def test_a_mask_allowing_only_banned_tokens_keeps_the_grammar() -> None:
    """min_tokens bans EOS, the grammar allows only EOS: the grammar wins for that step."""
    params = [ProcessorParams(min_tokens=5, min_tokens_banned_ids=(2,), num_prompt_tokens=2)]
    batch, step = batch_with(params, [[7, 8]])
    processors = batch.processors(step, (np.array([0]), bitmask([[2]])))
    tokens, _ = sample(logits_for(1), batch.sampling(step)[1], processors=processors)
    assert tokens.tolist() == [2]


def test_processors_copy_only_the_rows_they_process() -> None:
    """The processors copy only the rows that use any of them, and place those
    among the step's random rows by position (plain rows 1, 2; filtered rows 3, 4)."""
    batch = InputBatch(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=64, block_size=4, device=CPU,
                       vocab_size=VOCAB)
    rows = [  # (temperature, top_p, params)
        (0.0, 1.0, ProcessorParams()),                                                # greedy
        (0.8, 1.0, ProcessorParams(logit_bias_ids=(3,), logit_bias_values=(1.0,))),   # plain, biased
        (0.8, 1.0, ProcessorParams()),                                                # plain
        (0.7, 0.9, ProcessorParams()),                                                # filtered, masked
        # filtered, min_tokens reached (the token sampled at 2 is the second): no ban
        (0.7, 0.9, ProcessorParams(min_tokens=1, min_tokens_banned_ids=(2,), num_prompt_tokens=1)),
    ]
    for sid, (temperature, top_p, params) in enumerate(rows):
        batch.add(sid, temperature, top_p, 0, seed=sid, params=params)
    step = batch.stage([StepChunk(sid, 0, [5, 6], True, sid) for sid in range(len(rows))])
    processors = batch.processors(step, (np.array([3]), bitmask([[7, 8]])))
    assert processors is not None
    assert processors.rows.tolist() == [1, 3]
    assert [t.tolist() for t in processors.in_plain] == [[0], [0]]      # plain row 0 is processed row 0
    assert [t.tolist() for t in processors.in_filtered] == [[0], [1]]   # filtered row 0 is processed row 1
    logits = logits_for(len(rows))
    want = logits[[1, 3]].clone()
    want[0, 3] += 1.0
    want[1] = want[1].masked_fill(~torch.isin(torch.arange(VOCAB), torch.tensor([7, 8])), NEG_INF)
    torch.testing.assert_close(processors.apply(logits), want, rtol=0, atol=0)


FILTERS = [  # temperature, min_p, top_k, top_p
    (1.0, 0.05, 0, 1.0),     # min-p alone: a plain row
    (0.7, 0.2, 0, 1.0),
    (1.3, 0.02, 6, 1.0),     # min-p, then top-k
    (1.0, 0.01, 0, 0.8),     # min-p, then top-p renormalised over what min-p kept
    (0.9, 0.03, 8, 0.7),
    (1.0, 0.0, 5, 0.9),      # no min-p
]


@pytest.mark.parametrize(("temperature", "min_p", "top_k", "top_p"), FILTERS)
def test_filters_keep_what_the_transformers_warpers_keep(temperature: float, min_p: float, top_k: int,
                                                          top_p: float) -> None:
    """min-p, then top-k, then top-p: the drawn support is the warpers' survivors, the
    frequencies their renormalised probabilities (candidates or full sort alike)."""
    vocab, draws = 64, 4000
    row = torch.linspace(4, -4, vocab)[None] + torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 0.3
    scaled = row / temperature
    for warper in (MinPLogitsWarper(min_p) if min_p else None, TopKLogitsWarper(top_k) if top_k else None,
                   TopPLogitsWarper(top_p) if top_p < 1 else None):
        if warper is not None:
            scaled = warper(torch.zeros(1, 1, dtype=torch.long), scaled)
    kept = set(torch.isfinite(scaled[0]).nonzero().squeeze(-1).tolist())
    probs = scaled.softmax(-1)[0]
    params = SamplingBatch.from_lists(temperature=[temperature] * draws, top_p=[top_p] * draws,
                                      top_k=[top_k] * draws, seed=[5] * draws, position=list(range(draws)),
                                      min_p=[min_p] * draws, device=CPU)
    logits = row.repeat(draws, 1)
    for candidates in (4, 256):
        tokens, _ = sample(logits, params, candidates=candidates)
        assert set(tokens.tolist()) == kept
        counts = torch.bincount(tokens, minlength=vocab).float()
        expected = probs * draws
        ids = sorted(kept)
        chi2 = float(((counts[ids] - expected[ids]) ** 2 / expected[ids]).sum())
        assert chi2 < 3 * len(ids) + 30, (counts[ids], expected[ids])


def test_greedy_takes_the_processed_argmax_and_reports_raw_logprobs() -> None:
    params = [ProcessorParams(logit_bias_ids=(100,), logit_bias_values=(50.0,), top_logprobs=3, num_prompt_tokens=1)]
    batch, step = batch_with(params, [[1, 2]])
    logits = logits_for(1)
    _, sampling, groups = batch.sampling(step)
    drawn = sample_step(logits, sampling, groups, processors=batch.processors(step),
                        top_rows=torch.tensor([0]), top_n=3)
    raw = logits.log_softmax(-1)
    assert drawn.tokens.tolist() == [100]
    torch.testing.assert_close(drawn.logprobs, raw[:, 100], rtol=0, atol=1e-6)
    assert drawn.top_ids is not None and drawn.top_logprobs is not None
    assert drawn.top_ids[0].tolist() == raw[0].topk(3).indices.tolist()
    torch.testing.assert_close(drawn.top_logprobs[0], raw[0].topk(3).values, rtol=0, atol=1e-6)


MIXED = [  # (temperature, top_p, top_k, params) of each row
    (0.0, 1.0, 0, ProcessorParams()),
    (0.9, 1.0, 0, ProcessorParams()),
    (0.8, 0.9, 20, ProcessorParams()),
    (0.0, 1.0, 0, ProcessorParams(repetition_penalty=1.3, frequency_penalty=0.5, num_prompt_tokens=3, top_logprobs=4)),
    (1.1, 1.0, 0, ProcessorParams(min_p=0.1, presence_penalty=1.0, num_prompt_tokens=3)),
    (0.7, 0.8, 0, ProcessorParams(logit_bias_ids=(9, 10), logit_bias_values=(3.0, -3.0), top_logprobs=2)),
    (1.0, 1.0, 30, ProcessorParams(min_tokens=9, min_tokens_banned_ids=(2, 3), num_prompt_tokens=3, min_p=0.05)),
]


def draw_rows(rows: list[int], logits: torch.Tensor, masked: dict[int, list[int]]) -> list[tuple]:
    """Sample ``rows`` of MIXED together: per row (token, logprob, top ids, top logprobs)."""
    batch = InputBatch(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=64, block_size=4, device=CPU,
                       vocab_size=VOCAB)
    for r in rows:
        t, p, k, params = MIXED[r]
        batch.add(r, t, p, k, seed=100 + r, params=params)
    history = [3, 4, 5, 5, 6, 7]
    step = batch.stage([StepChunk(r, 0, history, True, i) for i, r in enumerate(rows)])
    mask_rows = [i for i, r in enumerate(rows) if r in masked]
    masks = (np.array(mask_rows), bitmask([masked[rows[i]] for i in mask_rows])) if mask_rows else None
    _, sampling, groups = batch.sampling(step)
    top_index = np.flatnonzero(step.top_n)
    drawn = sample_step(logits[rows], sampling, groups, processors=batch.processors(step, masks),
                        top_rows=torch.from_numpy(top_index), top_n=int(step.top_n.max()))
    out = []
    for i in range(len(rows)):
        where, n = np.flatnonzero(top_index == i), MIXED[rows[i]][3].top_logprobs   # each row's own N
        top = (drawn.top_ids[where[0], :n].tolist(), drawn.top_logprobs[where[0], :n].tolist()) if len(where) else None
        out.append((int(drawn.tokens[i]), float(drawn.logprobs[i]), top))
    return out


def test_a_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    """Bit-identical tokens, logprobs and top logprobs, whatever else is batched."""
    logits = logits_for(len(MIXED), seed=3)
    masked = {2: list(range(0, 320, 3)), 4: [5, 6, 7, 200]}
    together = draw_rows(list(range(len(MIXED))), logits, masked)
    for r in range(len(MIXED)):
        assert draw_rows([r], logits, masked) == [together[r]], r
    # Rows without processors (0 and 1; 2 is masked): as they were before processors existed.
    sampling = SamplingBatch.from_lists(temperature=[MIXED[r][0] for r in (0, 1)], top_p=[1.0, 1.0], top_k=[0, 0],
                                        seed=[100, 101], position=[6, 6], device=CPU)
    tokens, logprobs = sample(logits[:2], sampling)
    assert [(int(t), float(lp), None) for t, lp in zip(tokens, logprobs)] == together[:2]


def test_top_tokens_rank_ties_by_the_lower_id() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 3.0, float("-inf"), -2.0]])
    assert top_tokens(x, 8)[0].tolist() == [1, 2, 5, 0, 3, 4, 7, 6]
    # bf16 values tie often; a flat row ties past any shortlist of candidates.
    y = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    y[3] = 0.5
    y[4, 900:] = 9.0
    for n in (1, 5, 50):
        ids = top_tokens(y, n)
        for row in range(len(y)):
            want = sorted(range(1000), key=lambda t: (-float(y[row, t]), t))[:n]
            assert ids[row].tolist() == want, (n, row)


@pytest.mark.parametrize("in_place", [False, True])
def test_mask_logits_is_masked_fill_by_numpys_unpacking(in_place: bool) -> None:
    """Bit for bit, special values included (-0.0, infinities, NaN, subnormals), words
    that allow every token or none (the C++ pass's shortcuts), a last word past V."""
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=(5, 10), dtype=np.int64).astype(np.int32)
    words[0, 0] |= 0x3F     # the special values below allowed in row 0, not in row 1
    words[1, 0] &= ~0x3F
    words[2, :] = -1        # every token allowed
    words[3, :] = 0         # none (a row the runner never sends; the op still masks it)
    words[4, 1:4] = (-1, 0, -1)
    logits = logits_for(5, 300)     # 300 = 9 x 32 + 12: the last word's 20 high bits are past V
    logits[:, :6] = torch.tensor([-0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40])
    want = logits.masked_fill(~torch.from_numpy(ref_allowed(words, 300)), NEG_INF)
    given = logits.clone()
    got = (mask_logits_ if in_place else mask_logits)(given, torch.from_numpy(words))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (got.data_ptr() == given.data_ptr()) == in_place      # in place on the CPU
    if not in_place:
        assert torch.equal(given.view(torch.int32), logits.view(torch.int32))


# -- plan validation ---------------------------------------------------------------

LIMITS = PlanLimits(num_blocks=32, block_size=4, context_length=64, vocab_size=VOCAB,
                    max_num_batched_tokens=64, max_num_seqs=8)

BAD_CONFIGS = {
    "min_p nan": pb.SamplingConfig(min_p=math.nan),
    "min_p above 1": pb.SamplingConfig(min_p=1.5),
    "negative repetition": pb.SamplingConfig(repetition_penalty=-1.0),
    "infinite repetition": pb.SamplingConfig(repetition_penalty=math.inf),
    "presence nan": pb.SamplingConfig(presence_penalty=math.nan, num_prompt_tokens=1),
    "frequency inf": pb.SamplingConfig(frequency_penalty=-math.inf, num_prompt_tokens=1),
    "bias lengths": pb.SamplingConfig(logit_bias_ids=[1, 2], logit_bias_values=[1.0]),
    "bias outside vocab": pb.SamplingConfig(logit_bias_ids=[VOCAB], logit_bias_values=[1.0]),
    "bias twice": pb.SamplingConfig(logit_bias_ids=[4, 4], logit_bias_values=[1.0, 2.0]),
    "bias inf": pb.SamplingConfig(logit_bias_ids=[4], logit_bias_values=[math.inf]),
    "banned outside vocab": pb.SamplingConfig(min_tokens=2, min_tokens_banned_ids=[VOCAB + 1], num_prompt_tokens=1),
    "bans everything": pb.SamplingConfig(min_tokens=2, min_tokens_banned_ids=range(VOCAB), num_prompt_tokens=1),
    "top_logprobs beyond vocab": pb.SamplingConfig(top_logprobs=VOCAB + 1),
    "prompt_logprobs beyond vocab": pb.SamplingConfig(prompt_logprobs=VOCAB + 1, num_prompt_tokens=1),
    "prompt beyond context": pb.SamplingConfig(num_prompt_tokens=65),
    "presence without prompt length": pb.SamplingConfig(presence_penalty=0.5),
    "min_tokens without prompt length": pb.SamplingConfig(min_tokens=3, min_tokens_banned_ids=[2]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_sampling_configs_are_refused(case: str) -> None:
    plan = pb.StepPlan(step_id=5, new_sequences=[pb.NewSequence(seq_id=1, sampling=BAD_CONFIGS[case])])
    with pytest.raises(PlanError, match="step 5: seq 1"):
        validate_plan(plan, {}, LIMITS)


def test_bad_chunks_for_the_new_fields_are_refused() -> None:
    new = pb.NewSequence(seq_id=1, sampling=pb.SamplingConfig(prompt_logprobs=2, num_prompt_tokens=8))
    unmasked = pb.StepPlan(step_id=1, new_sequences=[pb.NewSequence(seq_id=1)], chunks=[pb.ScheduledChunk(
        seq_id=1, start_position=0, token_ids=[1, 2], new_block_ids=[0], sample=False, masked=True)])
    with pytest.raises(PlanError, match="masked chunk must sample"):
        validate_plan(unmasked, {}, LIMITS)
    skipped = pb.StepPlan(step_id=1, new_sequences=[new], chunks=[pb.ScheduledChunk(
        seq_id=1, start_position=4, token_ids=[1, 2], new_block_ids=[0, 1])])
    with pytest.raises(PlanError, match="prompt_logprobs need every position"):
        validate_plan(skipped, {}, LIMITS)
    state = SequenceState(0.0, 1.0, 0, 0, block_table=[0, 1], params=ProcessorParams(prompt_logprobs=2,
                                                                                    num_prompt_tokens=8),
                          num_computed=4)
    gap = pb.StepPlan(step_id=2, chunks=[pb.ScheduledChunk(seq_id=1, start_position=5, token_ids=[3])])
    with pytest.raises(PlanError, match="after 4 computed"):
        validate_plan(gap, {1: state}, LIMITS)
    validate_plan(replace_start(gap, 4), {1: state}, LIMITS)


def replace_start(plan: pb.StepPlan, start: int) -> pb.StepPlan:
    copy = pb.StepPlan()
    copy.CopyFrom(plan)
    copy.chunks[0].start_position = start
    return copy
