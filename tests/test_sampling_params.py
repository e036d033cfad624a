"""The worker's sampling parameters beyond temperature / top-p / top-k.

Each logits processor against a reference on fixed logits (transformers'
processors and warpers where they exist, by hand otherwise); batch
invariance of mixed batches; penalty counts across preemption; top and
prompt logprobs against transformers' forward; grammar masks through the
runner and the worker's ZeroMQ loop; plan validation.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TopKLogitsWarper, TopPLogitsWarper)

from bench.tiny_models import make_tiny_llama
from tests.engine_sockets import SchedulerSockets
from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.config import WorkerConfig
from jitney.worker.input_batch import InputBatch, StepChunk
from jitney.worker.main import run_worker
from jitney.worker.plan import PlanError, PlanLimits, ProcessorParams, SequenceState, validate_plan
from jitney.worker.runner import MaskError, ModelRunner
from jitney.worker.sampler import SamplingBatch, apply_penalties, mask_logits, sample, sample_step, top_tokens

CPU = torch.device("cpu")
VOCAB = 320          # the tiny model's
EOS = 2
BLOCK = 4
NUM_BLOCKS = 96
NEG_INF = float("-inf")


# -- references --------------------------------------------------------------

def ref_penalties(logits: torch.Tensor, prompt: list[list[int]], output: list[list[int]],
                  rep: list[float], presence: list[float], frequency: list[float]) -> torch.Tensor:
    """transformers' repetition penalty over prompt + output, then frequency and presence by hand."""
    out = logits.clone()
    for i in range(len(out)):
        seen = torch.tensor([prompt[i] + output[i]])
        out[i:i + 1] = RepetitionPenaltyLogitsProcessor(rep[i])(seen, out[i:i + 1])
        counts = torch.bincount(torch.tensor(output[i], dtype=torch.int64), minlength=out.shape[1]).float()
        out[i] = out[i] - frequency[i] * counts
        out[i] = out[i] - presence[i] * (counts > 0).float()
    return out


def ref_allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmask words (M, W) int32 -> allowed (M, vocab), by numpy's little-endian unpacking."""
    return np.unpackbits(words.astype("<i4").view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)


def bitmask(allowed_ids: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    words = np.zeros((len(allowed_ids), -(-vocab // 32)), dtype=np.int64)
    for row, ids in enumerate(allowed_ids):
        for t in ids:
            words[row, t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)


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


def test_mask_logits_is_masked_fill_by_numpys_unpacking() -> None:
    """Bit for bit, special values included (-0.0, infinities, NaN, subnormals)."""
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=(3, 10), dtype=np.int64).astype(np.int32)
    words[0, 0] |= 0x3F     # the special values below allowed in row 0, not in row 1
    words[1, 0] &= ~0x3F
    logits = logits_for(3, 300)
    logits[:, :6] = torch.tensor([-0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40])
    want = logits.masked_fill(~torch.from_numpy(ref_allowed(words, 300)), NEG_INF)
    got = mask_logits(logits, torch.from_numpy(words))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


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


# -- through the runner (tiny model) --------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("sampling") / "tiny")


@pytest.fixture(scope="module")
def config(model_dir: Path) -> WorkerConfig:
    return WorkerConfig(model=str(model_dir), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS,
                        max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()


@torch.inference_mode()
def ref_log_softmax(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax (len(ids), vocab) after each position."""
    return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@dataclass
class Seq:
    tokens: list[int]
    sampling: pb.SamplingConfig
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    known: bool = False
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: dict[int, tuple[int, float, list[tuple[int, float]]]] = field(default_factory=dict)


class Driver:
    """A minimal scheduler: blocks, plans, masks on request; keeps every result."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(NUM_BLOCKS - 1, -1, -1))
        self.seqs: dict[int, Seq] = {}
        self.step_id = 0
        self.masks: dict[int, list[int]] = {}    # seq_id -> allowed token ids of its next samples

    def add(self, sid: int, prompt: list[int], **sampling: object) -> None:
        config = pb.SamplingConfig(num_prompt_tokens=len(prompt), **sampling)  # type: ignore[arg-type]
        self.seqs[sid] = Seq(list(prompt), config)

    def preempt(self, sid: int) -> None:
        seq = self.seqs[sid]
        self.free += seq.blocks
        seq.blocks, seq.computed, seq.known = [], 0, False
        seq.sampling.ClearField("prompt_logprobs")   # asked for once

    def plan(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> pb.StepPlan:
        plan = pb.StepPlan(step_id=self.step_id, freed_seq_ids=list(freed))
        self.step_id += 1
        for sid, n in budget.items():
            seq = self.seqs[sid]
            if not seq.known:
                plan.new_sequences.add(seq_id=sid, sampling=seq.sampling)
                seq.known = True
            n = min(n, len(seq.tokens) - seq.computed)
            need = math.ceil((seq.computed + n) / BLOCK) - len(seq.blocks)
            new_blocks = [self.free.pop() for _ in range(need)]
            seq.blocks += new_blocks
            sample = seq.computed + n == len(seq.tokens)
            plan.chunks.add(seq_id=sid, start_position=seq.computed, new_block_ids=new_blocks,
                            token_ids=seq.tokens[seq.computed:seq.computed + n], sample=sample,
                            masked=sample and sid in self.masks)
            seq.computed += n
        return plan

    def masks_for(self, plan: pb.StepPlan) -> pb.StepMasks:
        sids = [c.seq_id for c in plan.chunks if c.masked]
        return pb.StepMasks(step_id=plan.step_id, seq_ids=sids,
                            bitmask=bitmask([self.masks[s] for s in sids]).astype("<i4").tobytes())

    def step(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> pb.StepResult:
        plan = self.plan(budget, freed)
        result = self.runner.execute(plan, lambda step_id: self.masks_for(plan))
        self.take(result)
        return result

    def take(self, result: pb.StepResult) -> None:
        offset = 0
        for sid, token, logprob in zip(result.seq_ids, result.token_ids, result.logprobs):
            seq = self.seqs[sid]
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            n = seq.sampling.top_logprobs
            seq.top.append(list(zip(result.top_token_ids[offset:offset + n], result.top_logprobs[offset:offset + n])))
            offset += n
        assert offset == len(result.top_token_ids)
        for entry in result.prompt_logprobs:
            seq = self.seqs[entry.seq_id]
            n = seq.sampling.prompt_logprobs
            for i, (token, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
                top = list(zip(entry.top_token_ids[i * n:(i + 1) * n], entry.top_logprobs[i * n:(i + 1) * n]))
                assert entry.start_position + i not in seq.prompt_logprobs
                seq.prompt_logprobs[entry.start_position + i] = (token, logprob, top)

    def generate(self, sids: list[int], steps: int, chunk: int = 64) -> None:
        for _ in range(steps):
            self.step({sid: chunk for sid in sids})


PROMPTS = {1: [5, 17, 42, 99, 3, 250, 7, 8, 11, 60, 61], 2: [300, 2, 19, 77, 140, 141, 142],
           3: list(range(30, 53)), 4: [7, 7, 7, 9, 9, 100]}


def output(driver: Driver, sid: int) -> list[int]:
    return driver.seqs[sid].tokens[len(PROMPTS[sid]):]


def test_penalised_greedy_generation_follows_the_reference(config: WorkerConfig, reference: torch.nn.Module) -> None:
    """Each greedy token is the argmax of transformers' logits through the reference processors."""
    driver = Driver(ModelRunner(config))
    sampling = dict(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4,
                    logit_bias_ids=[11, 12], logit_bias_values=[1.5, -2.0])
    driver.add(1, PROMPTS[1], **sampling)
    driver.add(4, PROMPTS[4], repetition_penalty=0.5)   # < 1 rewards repeats
    driver.generate([1, 4], steps=8)
    for sid, rep, presence, frequency, bias in ((1, 1.8, 0.7, 0.4, {11: 1.5, 12: -2.0}), (4, 0.5, 0.0, 0.0, {})):
        tokens, n = driver.seqs[sid].tokens, len(PROMPTS[sid])
        for k in range(n, len(tokens)):
            with torch.inference_mode():
                logits = reference(torch.tensor([tokens[:k]])).logits[0, -1:].float()
            want = ref_penalties(logits, [tokens[:n]], [tokens[n:k]], [rep], [presence], [frequency])
            for t, b in bias.items():
                want[0, t] += b
            assert float(want[0, tokens[k]]) >= float(want.max()) - 1e-4, (sid, k)
            torch.testing.assert_close(driver.seqs[sid].logprobs[k - n], float(logits.log_softmax(-1)[0, tokens[k]]),
                                       rtol=0, atol=1e-4)
    assert len(set(output(driver, 4))) < len(output(driver, 4))   # rewarded repeats show


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalty_counts_are_rebuilt_after_preemption(config: WorkerConfig, temperature: float) -> None:
    sampling = dict(temperature=temperature, seed=7, repetition_penalty=1.4, presence_penalty=0.5,
                    frequency_penalty=0.8, top_logprobs=3)
    steady = Driver(ModelRunner(config))
    steady.add(1, PROMPTS[1], **sampling)
    steady.generate([1], steps=10)
    bumpy = Driver(ModelRunner(config))
    bumpy.add(1, PROMPTS[1], **sampling)
    bumpy.add(2, PROMPTS[2], frequency_penalty=1.0)
    bumpy.generate([1, 2], steps=4)
    bumpy.preempt(1)   # freed and re-added in the same plan; its row zeroed, then recounted
    bumpy.step({1: 9, 2: 1}, freed=(1,))
    bumpy.generate([1, 2], steps=6)
    assert output(bumpy, 1) == output(steady, 1)
    assert bumpy.seqs[1].logprobs == steady.seqs[1].logprobs
    assert bumpy.seqs[1].top == steady.seqs[1].top
    # Its counts now: the output so far, but the last sampled token (computed at the next step).
    batch = bumpy.runner.batch
    assert batch.counts.output is not None
    done = output(bumpy, 1)[:-1]
    assert batch.counts.output[batch.rows[1]].tolist() == torch.bincount(
        torch.tensor(done), minlength=VOCAB).tolist()


def test_a_mixed_batch_through_the_runner_equals_each_alone(config: WorkerConfig) -> None:
    """Bit-identical tokens, logprobs, top logprobs and prompt logprobs, batched or alone."""
    configs = {
        1: dict(temperature=0.8, seed=1, min_p=0.05, top_logprobs=2, prompt_logprobs=3),
        2: dict(),   # greedy, nothing else
        3: dict(temperature=1.0, top_k=40, seed=3, repetition_penalty=1.2, frequency_penalty=0.3,
                logit_bias_ids=[5], logit_bias_values=[2.0]),
        4: dict(temperature=0.7, seed=4, min_tokens=4, min_tokens_banned_ids=[EOS, 9], top_logprobs=5),
    }
    masks = {4: [t for t in range(VOCAB) if t % 2 == 0]}

    def run(sids: list[int]) -> Driver:
        driver = Driver(ModelRunner(config))
        driver.masks = {s: m for s, m in masks.items() if s in sids}
        for sid in sids:
            driver.add(sid, PROMPTS[sid], **configs[sid])
        driver.generate(sids, steps=7, chunk=9)
        return driver

    together = run([1, 2, 3, 4])
    for sid in configs:
        alone = run([sid]).seqs[sid]
        seq = together.seqs[sid]
        assert (alone.tokens, alone.logprobs, alone.top, alone.prompt_logprobs) == (
            seq.tokens, seq.logprobs, seq.top, seq.prompt_logprobs), sid
    assert all(t % 2 == 0 for t in output(together, 4))
    assert EOS not in output(together, 4)[:4] and 9 not in output(together, 4)[:4]


def test_top_and_prompt_logprobs_match_the_reference_forward(config: WorkerConfig,
                                                             reference: torch.nn.Module) -> None:
    """Top-N of the raw log-softmax after each sample; each prompt token's logprob under the
    positions before it and its alternatives, with the prompt computed in chunks of 5."""
    driver = Driver(ModelRunner(config))
    driver.add(3, PROMPTS[3], temperature=1.0, seed=5, top_logprobs=4, prompt_logprobs=3, repetition_penalty=1.3)
    driver.add(1, PROMPTS[1], top_logprobs=2)
    for _ in range(5):   # 23 prompt tokens in chunks of 5, seq 1 decoding alongside
        driver.step({3: 5, 1: 64})
    driver.generate([1, 3], steps=3)
    for sid, n in ((3, 4), (1, 2)):
        tokens, start = driver.seqs[sid].tokens, len(PROMPTS[sid])
        lsm = ref_log_softmax(reference, tokens)
        for k, top in enumerate(driver.seqs[sid].top):
            want = lsm[start + k - 1]
            assert [t for t, _ in top] == want.topk(n).indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), want.topk(n).values, rtol=0, atol=1e-4)
            torch.testing.assert_close(driver.seqs[sid].logprobs[k], float(want[tokens[start + k]]), rtol=0, atol=1e-4)
    prompt = PROMPTS[3]
    got = driver.seqs[3].prompt_logprobs
    lsm = ref_log_softmax(reference, prompt)
    assert sorted(got) == list(range(1, len(prompt)))
    for q, (token, logprob, top) in got.items():
        assert token == prompt[q]
        torch.testing.assert_close(logprob, float(lsm[q - 1, token]), rtol=0, atol=1e-4)
        assert [t for t, _ in top] == lsm[q - 1].topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), lsm[q - 1].topk(3).values, rtol=0, atol=1e-4)
    assert not driver.seqs[1].prompt_logprobs
    # In one chunk: the same bits.
    one_shot = Driver(ModelRunner(config))
    one_shot.add(3, PROMPTS[3], temperature=1.0, seed=5, top_logprobs=4, prompt_logprobs=3, repetition_penalty=1.3)
    one_shot.generate([3], steps=4)
    assert one_shot.seqs[3].prompt_logprobs == got
    assert one_shot.seqs[3].tokens == driver.seqs[3].tokens[:len(one_shot.seqs[3].tokens)]


def test_masks_constrain_the_sample(config: WorkerConfig, reference: torch.nn.Module) -> None:
    driver = Driver(ModelRunner(config))
    allowed = [40, 41, 42, 250, 251]
    driver.masks = {1: allowed, 2: [EOS, 7]}
    driver.add(1, PROMPTS[1])                    # greedy: the best allowed token
    driver.add(2, PROMPTS[2], temperature=1.0, seed=2, min_tokens=3, min_tokens_banned_ids=[EOS])
    driver.generate([1, 2], steps=4)
    tokens = driver.seqs[1].tokens
    for k in range(len(PROMPTS[1]), len(tokens)):
        lsm = ref_log_softmax(reference, tokens[:k])[-1]
        assert tokens[k] == allowed[int(lsm[allowed].argmax())]
        torch.testing.assert_close(driver.seqs[1].logprobs[k - len(PROMPTS[1])], float(lsm[tokens[k]]),
                                   rtol=0, atol=1e-4)
    assert output(driver, 2)[:3] == [7, 7, 7]    # EOS banned for three tokens


def test_masks_that_do_not_fit_fail_the_step(config: WorkerConfig) -> None:
    runner = ModelRunner(config)
    driver = Driver(runner)
    driver.masks = {1: [5]}
    driver.add(1, PROMPTS[1])
    words = -(-VOCAB // 32)

    def attempt(make: object, match: str) -> None:
        plan = driver.plan({1: 64})
        with pytest.raises(MaskError, match=match):
            runner.execute(plan, make)  # type: ignore[arg-type]
        runner.execute(pb.StepPlan(step_id=driver.step_id, freed_seq_ids=[1]))
        driver.step_id += 1
        driver.preempt(1)

    attempt(lambda step_id: pb.StepMasks(step_id=step_id + 1, seq_ids=[1], bitmask=b"\xff" * 4 * words),
            "masks for step")
    attempt(lambda step_id: pb.StepMasks(step_id=step_id, seq_ids=[2], bitmask=b"\xff" * 4 * words), "for seqs")
    attempt(lambda step_id: pb.StepMasks(step_id=step_id, seq_ids=[1], bitmask=b"\xff" * 4), "mask bytes")
    attempt(lambda step_id: pb.StepMasks(step_id=step_id, seq_ids=[1], bitmask=b"\x00" * 4 * words),
            "allows no token")
    with pytest.raises(PlanError, match="no masks to wait for"):
        runner.execute(driver.plan({1: 64}))
    assert 1 not in runner.sequences


class FakeDecodeGraphs:
    """Stands in for ``DecodeGraphs`` on the CPU: decode-only steps run the forward eagerly
    over the staging buffer; the graph's own greedy choice is a sentinel (token 0, logprob 0),
    so an output of zeros shows that the runner took it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def size_for(self, chunks: list[StepChunk]) -> int | None:
        return len(chunks) if all(len(c.tokens) == 1 for c in chunks) else None

    def mixed_bucket(self, num_tokens: int) -> None:
        return None

    def logits(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, model = self.runner.batch, self.runner.model
        meta = b.metadata(size, size, query_start_loc_host=tuple(range(size + 1)),
                          seq_lens_host=tuple(b.region("seq_lens", size).tolist()), num_decodes=size)
        hidden = model(b.region("input_ids", size), b.region("positions", size), meta, self.runner.cache)
        return model.compute_logits(hidden, torch.arange(size)), torch.zeros(2, size, dtype=torch.float64)


FAST_PATH_CASES = {
    "nothing": {},
    "bias": dict(logit_bias_ids=[77], logit_bias_values=[30.0]),
    "penalty": dict(repetition_penalty=1.5),
    "min_tokens": dict(min_tokens=9, min_tokens_banned_ids=[EOS]),
    "top_logprobs": dict(top_logprobs=2),
    "mask": dict(),
}


@pytest.mark.parametrize("case", sorted(FAST_PATH_CASES))
def test_the_decode_graph_fast_path_yields_to_processors(config: WorkerConfig, case: str) -> None:
    """All-greedy decode steps take the graph's own argmax only when no row is processed."""
    def run(graphs: bool) -> Driver:
        runner = ModelRunner(config)
        if graphs:
            runner.graphs = FakeDecodeGraphs(runner)  # type: ignore[assignment]
        driver = Driver(runner)
        if case == "mask":
            driver.masks = {1: list(range(100, 300))}
        driver.add(1, PROMPTS[1], **FAST_PATH_CASES[case])
        driver.add(4, PROMPTS[4])
        driver.generate([1, 4], steps=4)
        return driver

    want, got = run(graphs=False), run(graphs=True)
    if case == "nothing":   # the prefill step samples eagerly, the decode steps take the graph's choice
        assert output(got, 1)[1:] == output(got, 4)[1:] == [0, 0, 0]
        return
    for sid in (1, 4):
        assert (got.seqs[sid].tokens, got.seqs[sid].logprobs, got.seqs[sid].top) == (
            want.seqs[sid].tokens, want.seqs[sid].logprobs, want.seqs[sid].top)


# -- the worker's ZeroMQ loop ------------------------------------------------------------

def test_worker_loop_waits_for_masks(config: WorkerConfig, tmp_path: Path) -> None:
    scheduler = SchedulerSockets(f"ipc://{tmp_path}/plan", f"ipc://{tmp_path}/result")
    cfg = replace(config, plan_addr=f"ipc://{tmp_path}/plan", result_addr=f"ipc://{tmp_path}/result")
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(run_worker(cfg)))
    thread.start()
    send, reply = scheduler.send, scheduler.reply

    def masks(step_id: int, sids: list[int], allowed: list[int]) -> pb.StepMasks:
        return pb.StepMasks(step_id=step_id, seq_ids=sids,
                            bitmask=bitmask([allowed] * len(sids)).astype("<i4").tobytes())

    def fresh(step_id: int) -> pb.StepPlan:
        """A reset plan (after a failed step) that starts seq 1 over, masked."""
        return pb.StepPlan(step_id=step_id, reset=True, new_sequences=[pb.NewSequence(seq_id=1)], chunks=[
            pb.ScheduledChunk(seq_id=1, start_position=0, token_ids=[1, 2, 3], new_block_ids=[3], sample=True,
                              masked=True)])

    try:
        scheduler.ready()
        first = pb.StepPlan(step_id=1, new_sequences=[pb.NewSequence(seq_id=1), pb.NewSequence(seq_id=2)])
        first.chunks.add(seq_id=1, start_position=0, token_ids=[1, 2, 3], new_block_ids=[0], sample=True, masked=True)
        first.chunks.add(seq_id=2, start_position=0, token_ids=[4, 5], new_block_ids=[1], sample=True)
        second = pb.StepPlan(step_id=2, chunks=[
            pb.ScheduledChunk(seq_id=1, start_position=3, last_token_from_sample=True, sample=True),
            pb.ScheduledChunk(seq_id=2, start_position=2, last_token_from_sample=True, sample=True)])
        send(plan=first)
        send(plan=second)            # queued while step 1 waits for its masks
        send(masks=masks(1, [1], [99]))
        got = reply().result
        assert got.step_id == 1 and list(got.seq_ids) == [1, 2] and got.token_ids[0] == 99
        assert reply().result.step_id == 2
        # A refused masked plan, then one planned before the refusal was known (discarded):
        # their masks, when they come, are dropped, not taken by the next (reset) step.
        refused = pb.StepPlan(step_id=3, chunks=[pb.ScheduledChunk(seq_id=7, start_position=0, token_ids=[1],
                                                                   sample=True, masked=True)])
        send(plan=refused)
        assert "unknown seq_id 7" in reply().error.message
        send(masks=masks(3, [7], [1]))
        fourth = pb.StepPlan(step_id=4, chunks=[pb.ScheduledChunk(seq_id=1, start_position=4, new_block_ids=[2],
                                                                  last_token_from_sample=True, sample=True,
                                                                  masked=True)])
        send(plan=fourth)
        assert reply().error.discarded
        send(masks=masks(4, [1], [7]))
        send(plan=fresh(5))
        send(masks=masks(5, [1], [123]))
        got = reply().result
        assert got.step_id == 5 and list(got.token_ids) == [123]
        # Wrong masks fail that step only.
        send(plan=pb.StepPlan(step_id=6, chunks=[pb.ScheduledChunk(
            seq_id=1, start_position=3, last_token_from_sample=True, sample=True, masked=True)]))
        send(masks=masks(9, [1], [123]))
        assert "masks for step 9" in reply().error.message
        # A Shutdown while a step waits ends the worker.
        send(plan=fresh(7))
        send(shutdown=pb.Shutdown())
        thread.join(timeout=30)
        assert exit_code == [0]
    finally:
        scheduler.close()


def test_penalties_count_the_context_a_sequence_does_not_compute(config: WorkerConfig) -> None:
    """A penalised sequence that starts past 0 (a prefix-cache hit, or the
    prompt blocks an n > 1 sample shares) gets the skipped tokens as
    context_token_ids: its counts equal those of the sequence that computed
    everything, and so do its tokens."""
    runner = ModelRunner(config)
    driver = Driver(runner)
    prompt = list(range(40, 40 + 3 * BLOCK + 2))
    sampling = dict(repetition_penalty=1.6, frequency_penalty=0.9, presence_penalty=0.3)
    driver.add(1, prompt, **sampling)
    driver.step({1: 64})
    owner = driver.seqs[1]
    shared = owner.blocks[:2]               # 2 whole prompt blocks, written by the step above
    start = 2 * BLOCK
    new_blocks = [driver.free.pop(), driver.free.pop()]
    plan = pb.StepPlan(step_id=driver.step_id, new_sequences=[pb.NewSequence(
        seq_id=2, sampling=pb.SamplingConfig(num_prompt_tokens=len(prompt), **sampling),  # type: ignore[arg-type]
        context_token_ids=prompt[:start])])
    driver.step_id += 1
    plan.chunks.add(seq_id=2, start_position=start, token_ids=prompt[start:], sample=True,
                    new_block_ids=shared + new_blocks)
    result = runner.execute(plan)
    assert list(result.token_ids) == [owner.tokens[len(prompt)]]
    counts, rows = runner.batch.counts, runner.batch.rows
    assert counts.output is not None and counts.prompt is not None
    assert torch.equal(counts.prompt[rows[1]], counts.prompt[rows[2]])
    assert torch.equal(counts.output[rows[2]], torch.zeros_like(counts.output[rows[2]]))
    bad = pb.StepPlan(step_id=driver.step_id, new_sequences=[pb.NewSequence(
        seq_id=3, sampling=pb.SamplingConfig(num_prompt_tokens=len(prompt), **sampling),  # type: ignore[arg-type]
        context_token_ids=prompt[:start - 1])])
    bad.chunks.add(seq_id=3, start_position=start, token_ids=prompt[start:], sample=True,
                   new_block_ids=[driver.free.pop() for _ in range(4)])
    with pytest.raises(PlanError, match="context_token_ids must cover"):
        runner.execute(bad)
