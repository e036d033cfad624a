"""Speculative decoding with a draft model (``--speculative draft``): the
worker's draft model proposes, the scheduler verifies as for every drafter.

- the Engine's output (ids, logprobs, top logprobs, text) equals
  ``--speculative off`` bit for bit, with a random 2-layer draft of the
  target's shape (little accepted) and with the target itself as its own
  draft (every greedy draft accepted: the path is wired right), with a stop
  string, n = 2, penalties and seeded sampling in the mix, batched,
  alone and preempting; the draft's blocks all come back;
- the draft's cache follows the sequence: rolled back to the accepted
  tokens, freed on finish, cancel and preemption, rebuilt after a reset;
- a draft with another vocabulary or tokenizer is refused at load, and
  --speculative draft / --draft-model only go together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.plan import to_step_plan
from jitney.scheduler.core.request import FinishReason, Request
from jitney.scheduler.core.scheduler import Scheduler
from jitney.scheduler.core.speculative import ModelDrafter
from jitney.scheduler.core.trace import StepTracer, read_trace
from jitney.worker.config import WorkerConfig
from jitney.worker.models.config import UnsupportedModelError
from jitney.worker.runner.model_runner import ModelRunner
from jitney.worker.runner.plan_checks import PlanError
from tests.support.fake_worker import make_request
from tests.support.tiny_models import EOS_TOKEN_ID, make_tiny_llama
from tests.support.speculation_engine import (BLOCK, BUDGET, SEATS, VOCAB, AlwaysDraft, Collected,
                                              check_visibility, scheduler_config, serve_requests)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target") / "llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers of the target's shape, other random weights, the same tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft") / "llama", vocab_size=VOCAB, seed=7)


def make_runner(model: Path, draft: Path | None, num_blocks: int = 96,
                draft_num_blocks: int | None = None) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(model), dtype="float32", block_size=BLOCK, num_blocks=num_blocks,
                                    max_num_batched_tokens=BUDGET, max_num_seqs=SEATS, use_weights_cache=False,
                                    draft_model=str(draft) if draft else None, draft_num_blocks=draft_num_blocks))


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def stop(model: Path, tokenizer: Any) -> tuple[str, ...]:
    """A stop string from the middle of the last request's text (so a stop ends it)."""
    runner = make_runner(model, None)
    out, _ = asyncio.run(serve_requests(runner, scheduler_config(runner, "off"), tokenizer, True, ("zz",)))
    text = out.text[500]
    return (text[len(text) // 2:len(text) // 2 + 3],)


@pytest.fixture(scope="module")
def reference(model: Path, tokenizer: Any, stop: tuple[str, ...]) -> dict[int, Collected]:
    """--speculative off, per cache size (preemptions change nothing in the output)."""
    out = {}
    for num_blocks in (96, 24):
        runner = make_runner(model, None, num_blocks)
        out[num_blocks], _ = asyncio.run(serve_requests(runner, scheduler_config(runner, "off"), tokenizer, True, stop))
        assert out[num_blocks].finish[500] is FinishReason.STOP_SEQUENCE    # the stop string is exercised
    return out


def _check_no_leak(runner: ModelRunner, sched: Scheduler) -> None:
    draft = runner.draft
    assert draft is not None
    assert draft.num_free_blocks == draft.num_blocks, "draft blocks leaked"
    assert not draft._seqs and not draft.batch.rows
    assert isinstance(sched._drafter, ModelDrafter) and sched._drafter.num_kept == 0
    assert sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(("which", "batched", "num_blocks"),
                         [("random", True, 96), ("self", True, 96), ("self", False, 96), ("random", True, 24),
                          ("self", True, 24)],
                         ids=["random-batched", "self-batched", "self-alone", "random-preempting",
                              "self-preempting"])
def test_engine_output_is_the_same_with_a_draft_model(model: Path, random_draft: Path, tokenizer: Any,
                                                      reference: dict[int, Collected], stop: tuple[str, ...],
                                                      which: str, batched: bool,
                                                      num_blocks: int, tmp_path: Path) -> None:
    """Every proposal asked for and verified (AlwaysDraft: the rule reads measured
    times); the tokens, logprobs, text and finish reasons are those of off; the
    trace, the spec_decode_* metrics and the scheduler count the same drafts."""
    runner = make_runner(model, model if which == "self" else random_draft, num_blocks)
    assert runner.ready_message().draft_model
    config = scheduler_config(runner, "draft", k=4)
    tracer = StepTracer(tmp_path / "draft.jsonl")
    got, engine = asyncio.run(serve_requests(runner, config, tokenizer, batched, stop, tracer=tracer))
    tracer.close()
    check_visibility(engine, read_trace(tmp_path / "draft.jsonl"))
    # The stream ends before the plan that frees the last requests: one more plan brings it.
    runner.execute(to_step_plan(engine.scheduler.schedule(), frozenset({EOS_TOKEN_ID}), draft_model=True))
    off = reference[num_blocks]
    assert got.tokens == off.tokens
    assert got.logprobs == off.logprobs
    assert got.top == off.top and got.text == off.text and got.finish == off.finish
    sched = engine.scheduler
    assert sched.num_drafts > 0
    if which == "random":
        assert sched.num_accepted_tokens < sched.num_draft_tokens // 8
    else:   # greedy requests accept every draft, the sampled and biased ones fewer
        assert sched.num_accepted_tokens > sched.num_draft_tokens // 8
    _check_no_leak(runner, sched)


def _greedy_requests() -> list[Request]:
    return [make_request(1, [5, 17, 42, 99, 3, 250, 7], max_tokens=20, ignore_eos=True),
            make_request(2, list(range(30, 52)), max_tokens=18, ignore_eos=True),
            make_request(3, [300, 2, 19, 77, 140], max_tokens=15, ignore_eos=True)]


def _drive(runner: ModelRunner, sched: Scheduler, requests: list[Request], *, cancel: int | None = None,
           check: bool = True) -> list[list[int]]:
    """Plan, run, verify and hand the proposals over, as the engine does (one plan in
    flight); ``cancel``: that seq id is aborted after its 4th token. ``check``: after
    each step the draft holds, for every sequence, exactly its known tokens and its
    proposal's K/V (the rejected drafts' rolled back), and no more blocks than those."""
    for r in requests:
        sched.add_request(r)
    while sched.has_work():
        output = sched.schedule()
        plan = engine_pb2.StepPlan.FromString(
            to_step_plan(output, frozenset({EOS_TOKEN_ID}),
                         draft_model=sched.config.speculative == "draft").SerializeToString())
        result = runner.execute(plan)
        sched.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        sched.take_proposals([(p.seq_id, p.start_position, p.token_ids) for p in result.proposals],
                             result.draft_seconds, result.draft_proposed_tokens)
        if check:
            _check_draft_state(runner, sched, result)
        victim = sched.get_request(cancel) if cancel is not None else None
        if victim is not None and victim.num_output_tokens >= 4:
            sched.abort_request(cancel, FinishReason.CANCELLED)   # type: ignore[arg-type]
    return [r.output_token_ids for r in requests]


def _check_draft_state(runner: ModelRunner, sched: Scheduler, result: engine_pb2.StepResult) -> None:
    draft = runner.draft
    assert draft is not None
    for proposal in result.proposals:
        request = sched.get_request(proposal.seq_id)
        seq = draft._seqs[proposal.seq_id]
        if request is not None and not request.is_finished:
            assert seq.known == request.all_token_ids
        known = len(seq.known)
        assert proposal.start_position == known
        # K/V: the known tokens, then the proposal's but its last (never computed).
        assert seq.cached == seq.known + list(proposal.token_ids[:-1])
        assert len(seq.blocks) == -(-(known + len(proposal.token_ids) - 1) // BLOCK)
    held = sum(len(s.blocks) for s in draft._seqs.values())
    assert held + draft.num_free_blocks == draft.num_blocks


def test_self_draft_accepts_every_greedy_draft_and_follows_the_sequences(model: Path) -> None:
    """The target as its own draft: greedy, every draft is accepted (the draft's
    argmax is the target's choice) and the output is that of off."""
    runner = make_runner(model, model)
    off = _drive(make_runner(model, None), Scheduler(scheduler_config(runner, "off")), _greedy_requests(),
                 check=False)
    sched = Scheduler(scheduler_config(runner, "draft", k=4), frozenset({EOS_TOKEN_ID}), speculation=AlwaysDraft(4))
    assert _drive(runner, sched, _greedy_requests()) == off
    assert sched.num_draft_tokens > 20
    assert sched.num_accepted_tokens == sched.num_draft_tokens
    assert sched.speculation is not None and sched.speculation.draft_seconds_per_token > 0   # its cost, measured
    _check_no_leak(runner, sched)


def test_random_draft_rolls_back_and_frees_on_cancel_and_preemption(model: Path, random_draft: Path) -> None:
    """Mostly rejected drafts (each step's catch-up recomputes from the accepted
    tokens), a cancelled request, preemptions in a small cache, then a reset:
    the same output as off for the others, every draft block back."""
    runner = make_runner(model, random_draft, num_blocks=10)
    reference = _drive(make_runner(model, None, num_blocks=10),
                       Scheduler(scheduler_config(runner, "off")), _greedy_requests(), check=False)
    sched = Scheduler(scheduler_config(runner, "draft", k=4), frozenset({EOS_TOKEN_ID}), speculation=AlwaysDraft(4))
    requests = _greedy_requests()
    got = _drive(runner, sched, requests, cancel=2)
    assert got[0] == reference[0] and got[2] == reference[2]
    assert got[1] == reference[1][:len(got[1])] and len(got[1]) < len(reference[1])
    assert sched.num_accepted_tokens < sched.num_draft_tokens // 4 and sched.num_draft_tokens > 0
    assert any(r.num_preemptions for r in requests)
    _check_no_leak(runner, sched)
    # After a failed step the scheduler resets the worker: the draft forgets everything too.
    sched2 = Scheduler(scheduler_config(runner, "draft", k=4), frozenset({EOS_TOKEN_ID}), speculation=AlwaysDraft(4))
    for r in _greedy_requests():
        sched2.add_request(r)
    output = sched2.schedule()
    runner.execute(to_step_plan(output, frozenset({EOS_TOKEN_ID}), draft_model=True))
    assert runner.draft is not None and runner.draft._seqs
    runner.execute(engine_pb2.StepPlan(step_id=99, reset=True))
    assert not runner.draft._seqs and runner.draft.num_free_blocks == runner.draft.num_blocks


def test_prefix_hits_send_the_draft_its_context(model: Path) -> None:
    """A prompt whose prefix is cached: the target starts past it, the draft gets
    the prefix's tokens (draft_context_token_ids) and still drafts right."""
    runner = make_runner(model, model)
    prefix = [40 + i for i in range(16)]
    first, second = make_request(1, prefix + [7], max_tokens=6, ignore_eos=True), \
        make_request(2, prefix + [9, 8], max_tokens=12, ignore_eos=True)
    sched = Scheduler(scheduler_config(runner, "draft", k=3), frozenset({EOS_TOKEN_ID}), speculation=AlwaysDraft(3))
    _drive(runner, sched, [first])
    _drive(runner, sched, [second])
    assert second.num_cached_tokens == 16
    off = _drive(make_runner(model, None), Scheduler(scheduler_config(runner, "off")),
                 [make_request(2, prefix + [9, 8], max_tokens=12, ignore_eos=True)], check=False)
    assert second.output_token_ids == off[0]
    assert sched.num_accepted_tokens == sched.num_draft_tokens > 0
    _check_no_leak(runner, sched)


def test_a_full_draft_pool_only_costs_proposals(model: Path) -> None:
    """A draft cache too small for every sequence: those it cannot hold get no
    proposal (no drafts), the output is unchanged, nothing leaks."""
    runner = make_runner(model, model, draft_num_blocks=8)
    off = _drive(make_runner(model, None), Scheduler(scheduler_config(runner, "off")), _greedy_requests(),
                 check=False)
    sched = Scheduler(scheduler_config(runner, "draft", k=4), frozenset({EOS_TOKEN_ID}), speculation=AlwaysDraft(4))
    assert _drive(runner, sched, _greedy_requests()) == off
    assert sched.num_draft_tokens > 0
    _check_no_leak(runner, sched)


def test_plans_with_draft_fields_are_checked(model: Path, random_draft: Path) -> None:
    plain = make_runner(model, None)
    new = engine_pb2.NewSequence(seq_id=1, sampling=engine_pb2.SamplingConfig())
    chunk = engine_pb2.ScheduledChunk(seq_id=1, start_position=0, token_ids=[3, 4], new_block_ids=[0],
                                      sample=True, num_proposals=2)
    with pytest.raises(PlanError, match="no draft model"):
        plain.execute(engine_pb2.StepPlan(step_id=1, new_sequences=[new], chunks=[chunk]))
    drafting = make_runner(model, random_draft)
    quiet = engine_pb2.ScheduledChunk(seq_id=1, start_position=0, token_ids=[3, 4], new_block_ids=[0],
                                      sample=False, num_proposals=2)
    with pytest.raises(PlanError, match="does not sample"):
        drafting.execute(engine_pb2.StepPlan(step_id=1, new_sequences=[new], chunks=[quiet]))
    assert not drafting.sequences    # refused whole
    result = drafting.execute(engine_pb2.StepPlan(step_id=2, new_sequences=[new], chunks=[chunk]))
    assert [p.seq_id for p in result.proposals] == [1] and len(result.proposals[0].token_ids) == 2
    assert result.proposals[0].start_position == 3 and result.draft_proposed_tokens == 2


def test_a_draft_with_another_vocabulary_is_refused(model: Path, tmp_path: Path) -> None:
    other = make_tiny_llama(tmp_path / "other", vocab_size=VOCAB - 8)
    with pytest.raises(UnsupportedModelError, match="vocabulary has 312 tokens, the target's 320"):
        make_runner(model, other)


def test_a_draft_with_another_tokenizer_is_refused(model: Path, tmp_path: Path) -> None:
    other = make_tiny_llama(tmp_path / "other", vocab_size=VOCAB, seed=3)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]    # two tokens' ids swapped: same size, other ids
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(UnsupportedModelError, match="tokenizer differs from the target's"):
        make_runner(model, other)


def test_speculative_draft_and_draft_model_go_together(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from jitney.cli import main

    for argv in (["serve", "--speculative", "draft"], ["serve", "--draft-model", str(model)]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert "--speculative draft and --draft-model PATH go together" in capsys.readouterr().err
    # Started apart, the scheduler refuses a worker that does not match.
    from jitney.scheduler.core.worker_link import WorkerLinkError
    from jitney.scheduler.main import SchedulerProcessConfig, _make_engine, add_scheduler_arguments

    parser = argparse.ArgumentParser()
    add_scheduler_arguments(parser)
    for flags, ready in ((["--speculative", "draft"], engine_pb2.Ready()),
                         ([], engine_pb2.Ready(draft_model="tiny"))):
        cfg = SchedulerProcessConfig.from_namespace(parser.parse_args(flags))
        with pytest.raises(WorkerLinkError, match="draft"):
            _make_engine(cfg, None, None, ready, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft_num_blocks needs a draft_model"):
        WorkerConfig(draft_num_blocks=4)


def test_requests_under_a_grammar_are_not_asked_for_proposals() -> None:
    """A request under a grammar (may_draft False) is never asked for proposals."""
    config = SchedulerConfig(block_size=4, num_blocks=32, max_model_len=64, max_num_seqs=2,
                             max_num_batched_tokens=32, speculative="draft", num_speculative_tokens=3)
    sched = Scheduler(config, speculation=AlwaysDraft(3))
    free, bound = make_request(1, [1, 2, 3], max_tokens=8), make_request(2, [1, 2, 4], max_tokens=8)
    bound.may_draft = False
    sched.add_request(free)
    sched.add_request(bound)
    output = sched.schedule()
    assert {c.request.seq_id: c.num_proposals for c in output.scheduled} == {1: 3, 2: 0}
