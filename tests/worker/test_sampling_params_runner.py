"""The worker's sampling parameters through the runner (a tiny model) and the worker's
ZeroMQ loop: penalised generation against transformers' logits, penalty counts
across preemption, mixed batches equal to each row alone, top and prompt
logprobs against transformers' forward, grammar masks, the decode graphs' fast
path. The processors on fixed logits: test_sampling_params.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from tests.support import runner_driver
from tests.support.runner_driver import BLOCK, NUM_BLOCKS
from tests.support.tiny_models import make_tiny_llama
from tests.support.engine_sockets import SchedulerSockets
from tests.support.sampling_refs import EOS, VOCAB, bitmask, ref_penalties
from jitney.engine.v1 import engine_pb2 as pb
from jitney.worker.config import WorkerConfig
from jitney.worker.runner.input_batch import StepChunk
from jitney.worker.main import run_worker
from jitney.worker.runner.plan_checks import PlanError
from jitney.worker.runner.model_runner import MaskError, ModelRunner



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
class Seq(runner_driver.Seq):
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: dict[int, tuple[int, float, list[tuple[int, float]]]] = field(default_factory=dict)


class Driver(runner_driver.Driver):
    """``runner_driver.Driver`` with masks on request; keeps every result."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.seqs: dict[int, Seq] = {}  # type: ignore[assignment]
        self.masks: dict[int, list[int]] = {}    # seq_id -> allowed token ids of its next samples

    def add(self, sid: int, prompt: list[int], **sampling: object) -> None:  # type: ignore[override]
        config = pb.SamplingConfig(num_prompt_tokens=len(prompt), **sampling)  # type: ignore[arg-type]
        self.seqs[sid] = Seq(list(prompt), config)

    def preempt(self, sid: int) -> None:
        super().preempt(sid)
        self.seqs[sid].sampling.ClearField("prompt_logprobs")   # asked for once

    def masked(self, sid: int) -> bool:
        return sid in self.masks

    def masks_for(self, plan: pb.StepPlan) -> pb.StepMasks:
        sids = [c.seq_id for c in plan.chunks if c.masked]
        return pb.StepMasks(step_id=plan.step_id, seq_ids=sids,
                            bitmask=bitmask([self.masks[s] for s in sids]).astype("<i4").tobytes())

    def step(self, budget: dict[int, int], freed: tuple[int, ...] = ()) -> pb.StepResult:  # type: ignore[override]
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
