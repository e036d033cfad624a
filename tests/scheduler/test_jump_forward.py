"""Grammar jump-forward (engine.py, grammar.forced_run): where the grammar allows
one token at a time, those tokens ride the next chunk as known input instead of
being sampled one step each. The output is the same as without it, in fewer
sampled steps; requests that read logprobs always sample.

The forced runs are checked on the served tokenizer (SmolLM2's); the doors on
the scripted worker, which writes a chosen text under the masks and checks
every plan with the real worker's rules (tests/support/text_worker.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from jitney.scheduler.core.grammar import GrammarCompiler, GrammarMatcher, allocate_bitmask, forced_run, only_token
from tests.support.door_harness import Harness, text_worker_harness
from tests.support.grammar_formats import EOS, allowed, encode, schema
from tests.support.scripted_worker import MODEL, make_tokenizer

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string"}},
          "required": ["answer", "why"]}


def _mask(m: GrammarMatcher, vocab: int) -> np.ndarray:
    out = allocate_bitmask(1, vocab)[0]
    m.fill_bitmask(out)
    return out


def test_only_token_reads_a_one_bit_row() -> None:
    row = np.zeros(4, dtype=np.int32)
    assert only_token(row) is None
    row[2] = 1 << 5
    assert only_token(row) == 2 * 32 + 5
    row[3] = np.int32(-(1 << 31))       # bit 31 (the sign bit) of another word
    assert only_token(row) is None
    row[2] = 0
    assert only_token(row) == 3 * 32 + 31
    row[3] = 3
    assert only_token(row) is None


def test_a_forced_run_is_each_only_allowed_token_and_leaves_the_matcher_as_it_was(
        compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any) -> None:
    m = run(compiler.compile(schema(ANSWER))).new_matcher()
    before = _mask(m, vocab)
    first = only_token(before)
    assert first is not None          # '{"' is forced, then the key
    scratch = np.empty_like(before)
    forced = forced_run(m, first, 32, frozenset({EOS}), scratch)
    assert len(forced) >= 3
    assert np.array_equal(_mask(m, vocab), before)      # rolled back
    # Replayed by hand: each token was the one its mask allowed, and the next is free.
    for token in forced:
        assert list(allowed(m, vocab)) == [token]
        assert m.accept_token(token)
    assert len(allowed(m, vocab)) > 1
    assert tokenizer.decode(forced) == '{"answer": "'
    # The limit, and a token of ``stops`` ends the run before it.
    m.rollback(len(forced))
    assert forced_run(m, first, 2, frozenset({EOS}), scratch) == forced[:2]
    assert forced_run(m, first, 32, frozenset({forced[2]}), scratch) == forced[:2]
    assert forced_run(m, first, 32, frozenset({first}), scratch) == []


def test_a_forced_run_stops_before_eos(compiler: GrammarCompiler, tokenizer: Any, vocab: int, run: Any) -> None:
    m = run(compiler.compile(schema({"type": "object", "properties": {"k": {"const": "v"}},
                                     "required": ["k"]}))).new_matcher()
    first = only_token(_mask(m, vocab))
    assert first is not None
    forced = forced_run(m, first, 64, frozenset({EOS}), np.empty(-(-vocab // 32), dtype=np.int32))
    assert EOS not in forced and tokenizer.decode(forced) == '{"k": "v"}'


# -- through the doors --------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, Harness]]:
    tok = make_tokenizer()
    with text_worker_harness(tmp_path_factory.mktemp("jump"), tok) as jump, \
            text_worker_harness(tmp_path_factory.mktemp("step"), tok, jump_forward=False) as step:
        yield jump, step


def _engine(server: Harness) -> Any:
    assert server.servicer.state is not None
    return server.servicer.state.engine


def _ask(server: Harness, **kw: Any) -> tuple[Any, int, int]:
    """The reply, and the masked samples and forced tokens it took."""
    server.worker.target = CALL
    server.worker.spelled.clear()
    samples, forced = server.worker.masked_samples, _engine(server).num_forced_tokens
    reply = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, **kw)
    return (reply, server.worker.masked_samples - samples, _engine(server).num_forced_tokens - forced)


def _without_ids(reply: Any) -> dict[str, Any]:
    """The reply's message and finish reason, the calls' random ids left out."""
    message = reply.choices[0].message.model_dump()
    for call in message.get("tool_calls") or []:
        call.pop("id")
    return {"message": message, "finish": reply.choices[0].finish_reason}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tokens_ride_as_input_and_the_call_is_the_same(servers: tuple[Harness, Harness],
                                                              choice: Any) -> None:
    jump, step = servers
    fast, fast_samples, forced = _ask(jump, tool_choice=choice)
    slow, slow_samples, none = _ask(step, tool_choice=choice)
    assert none == 0 and forced > 0
    assert _without_ids(fast) == _without_ids(slow)
    [tc] = fast.choices[0].message.tool_calls or []
    assert json.loads(tc.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert fast.usage.completion_tokens == slow.usage.completion_tokens
    # Every forced token but the first of each run was not sampled.
    assert fast_samples < slow_samples
    assert _engine(jump).scheduler.block_manager.num_used_blocks == 0


def test_streamed_call_is_the_same_with_and_without(servers: tuple[Harness, Harness]) -> None:
    def streamed(server: Harness) -> tuple[str, list[str]]:
        server.worker.target = CALL
        server.worker.spelled.clear()
        name, fragments = "", []
        for chunk in server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                                           tool_choice="required", stream=True):
            for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                name += tc.function.name or ""
                fragments.append(tc.function.arguments or "")
        return name, fragments

    jump, step = servers
    fast, slow = streamed(jump), streamed(step)
    assert fast[0] == slow[0] == "get_weather"
    assert "".join(fast[1]) == "".join(slow[1]) == '{"city": "Paris", "unit": "celsius"}'


def test_a_request_reading_logprobs_samples_every_token(servers: tuple[Harness, Harness]) -> None:
    jump, step = servers
    with_logprobs, samples, forced = _ask(jump, tool_choice="required", logprobs=True)
    slow, slow_samples, _ = _ask(step, tool_choice="required", logprobs=True)
    # (a pipelined step may sample once past the end, its token dropped: the counts may differ by that)
    assert forced == 0 and abs(samples - slow_samples) <= 1 and samples >= with_logprobs.usage.completion_tokens
    assert _without_ids(with_logprobs) == _without_ids(slow)
    logprobs = with_logprobs.choices[0].logprobs
    assert logprobs is not None and len(logprobs.content or []) == with_logprobs.usage.completion_tokens


def test_forced_run_cut_by_max_tokens_ends_with_length(servers: tuple[Harness, Harness]) -> None:
    jump, step = servers
    replies = []
    for server in servers:
        server.worker.target = CALL
        server.worker.spelled.clear()
        replies.append(server.client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5, tool_choice="required"))
    fast, slow = replies
    assert fast.choices[0].finish_reason == slow.choices[0].finish_reason == "length"
    assert fast.usage.completion_tokens == slow.usage.completion_tokens == 5
    assert _engine(jump).scheduler.block_manager.num_used_blocks == 0


# -- the scheduler's accounting -------------------------------------------------------------

def _forced_oracle(request: Any, step_id: int, k: int) -> None:
    """What the engine does for a jump-forward request when it sends step ``step_id``'s
    masks: the run that step's sample starts, here the fake model's own next ``k``
    tokens (a grammar that forces exactly what the model would pick)."""
    from tests.support.fake_worker import expected_token
    history, run = list(request.all_token_ids), []
    for _ in range(min(k, request.sampling.max_tokens - request.num_output_tokens - 1)):
        run.append(expected_token(history))
        history.append(run[-1])
    if len(run) > 1:
        request.forced_token_ids, request.forced_step = run, step_id


@pytest.mark.parametrize("k, block_size, budget", [(2, 16, 64), (5, 4, 64), (12, 4, 16), (30, 16, 512)])
def test_forced_runs_in_a_pipelined_batch_give_the_reference_output(k: int, block_size: int, budget: int) -> None:
    from jitney.scheduler.core.config import SchedulerConfig
    from jitney.scheduler.core.scheduler import Scheduler
    from tests.support.fake_worker import FakeWorker, make_request, reference_output, wire_plan

    config = SchedulerConfig(block_size=block_size, num_blocks=400, max_model_len=512, max_num_seqs=4,
                             max_num_batched_tokens=budget)
    scheduler, worker = Scheduler(config), FakeWorker.for_config(config)
    requests = [make_request(i, 7 + 3 * i, max_tokens=20 + i) for i in range(6)]
    for r in requests:
        scheduler.add_request(r)
    in_flight: list[tuple[Any, Any]] = []
    sampled = 0
    while scheduler.has_work() or in_flight:
        if len(in_flight) < 2:
            output = scheduler.schedule()
            if not output.is_empty:
                sampled += sum(c.sample for c in output.scheduled)
                in_flight.append((output, worker.execute(wire_plan(output))))
                continue
        output, result = in_flight.pop(0)
        scheduler.update_from_output(output, list(result.seq_ids), list(result.token_ids), list(result.logprobs))
        scheduler.check_invariants()
        if in_flight:      # the engine's mask time for the step now in flight
            nxt = in_flight[0][0]
            for chunk in nxt.scheduled:
                r = chunk.request
                if chunk.sample and not r.is_finished and r.num_pending_samples == 1 and not r.forced_token_ids:
                    _forced_oracle(r, nxt.step_id, k)
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens), r.seq_id
        assert len(r.output_logprobs) == len(r.output_token_ids)
    assert scheduler.block_manager.num_used_blocks == 0
    assert sampled < sum(r.sampling.max_tokens for r in requests)     # forced tokens were not sampled


def test_a_sample_other_than_the_forced_token_is_refused_before_anything_changes() -> None:
    from jitney.scheduler.core.config import SchedulerConfig
    from jitney.scheduler.core.scheduler import Scheduler
    from tests.support.fake_worker import FakeWorker, make_request, wire_plan

    config = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_seqs=2,
                             max_num_batched_tokens=32)
    scheduler, worker = Scheduler(config), FakeWorker.for_config(config)
    request = make_request(1, 5, max_tokens=10)
    scheduler.add_request(request)
    first = scheduler.schedule()
    worker.execute(wire_plan(first))
    request.forced_token_ids, request.forced_step = [7, 8, 9], first.step_id
    with pytest.raises(ValueError, match="allowed only 7"):
        scheduler.update_from_output(first, [1], [6], [0.0])
    assert request.output_token_ids == [] and request.num_pending_samples == 1
    # A failed step's forced run is forgotten with it.
    scheduler.recover_from_failed_step([first])
    assert request.forced_token_ids == [] and request.forced_step == 0
