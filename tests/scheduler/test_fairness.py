"""Fair share between tenants (scheduler/core/fairness.py, ``--fairness tenant``):
the scheduler driven through the fake worker, the tenant's sources and bounds,
the key file's weights, and the doors end to end with two API keys."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.fake_worker import FakeWorker, drive_step, make_request, reference_output, run_until_idle
from tests.support.security_keys import ALICE, BOB, TIMEOUT
from tests.support.server_harness import free_port
from jitney.scheduler.core import fairness as fairness_module
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.fairness import (MAX_TENANT_CHARS, OUTPUT_TOKEN_WEIGHT, PROMPT_TOKEN_WEIGHT,
                                            TenantFairness, tenant_problem)
from jitney.scheduler.core.request import Request, RequestStatus
from jitney.scheduler.core.scheduler import Scheduler, SchedulerOutput
from jitney.scheduler.main import SchedulerProcessConfig, tenant_weight
from jitney.scheduler.security.tls import SecurityError, ServerSecurity, parse_api_keys
from jitney.v1 import generation_pb2 as pb


def make(fairness: str = "tenant", *, num_blocks: int = 256, max_num_seqs: int = 4,
         max_num_batched_tokens: int = 16, max_model_len: int = 64, block_size: int = 4,
         weights: tuple[tuple[str, float], ...] = (), prefix_caching: bool = False
         ) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=prefix_caching, fairness=fairness,  # type: ignore[arg-type]
                             tenant_weights=weights)
    return Scheduler(config), FakeWorker.for_config(config)


def request(seq_id: int, tenant: str, prompt: int = 8, max_tokens: int = 8, priority: int = 0,
            arrival: float | None = None) -> Request:
    r = make_request(seq_id, prompt, max_tokens=max_tokens, priority=priority, arrival_time=arrival,
                     ignore_eos=True)
    r.tenant = tenant
    return r


def weighted(output: SchedulerOutput) -> Counter[str]:
    """Each tenant's weighted tokens computed in a step, from the plan itself."""
    got: Counter[str] = Counter()
    for chunk in output.scheduled:
        p = chunk.request.num_prompt_tokens
        start, end = chunk.start_position, chunk.start_position + chunk.num_new_tokens
        prompt = max(0, min(end, p) - start)
        got[chunk.request.tenant] += PROMPT_TOKEN_WEIGHT * prompt + OUTPUT_TOKEN_WEIGHT * (end - start - prompt)
    return got


def live(requests: list[Request], tenant: str) -> bool:
    return any(r.tenant == tenant and not r.is_finished for r in requests)


def share_while_both_busy(s: Scheduler, w: FakeWorker, requests: list[Request], light: str,
                          heavy: str) -> float:
    """The light tenant's share of weighted tokens over the steps planned while
    both tenants had live work; every request must end with the reference output."""
    totals: Counter[str] = Counter()
    while s.has_work():
        both = live(requests, light) and live(requests, heavy)
        output, _ = drive_step(s, w)
        if both:
            totals += weighted(output)
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert totals[light] and totals[heavy]
    return totals[light] / (totals[light] + totals[heavy])


# -- the share ---------------------------------------------------------------------------


@pytest.mark.parametrize("light_first", [False, True])
def test_a_tenant_with_ten_times_the_load_does_not_crowd_out_the_other(light_first: bool) -> None:
    s, w = make()
    heavy = [request(i, "heavy", arrival=float(i)) for i in range(1, 101)]
    light = [request(1000 + i, "light", arrival=(0.5 if light_first else 200.0) + i) for i in range(10)]
    for r in heavy + light:
        s.add_request(r)
    share = share_while_both_busy(s, w, heavy + light, "light", "heavy")
    assert share >= 0.45
    rows = {row.tenant: row for row in s.tenant_report()}   # idle tenants keep their counters
    assert (rows["heavy"].prompt_tokens, rows["heavy"].output_tokens) == (800, 700)   # 7 fed back each
    assert all(row.waiting == row.running == 0 for row in rows.values())


def test_fcfs_lets_the_heavy_tenant_crowd_out_the_light_one() -> None:
    """The same load without fairness: the measure above does tell them apart."""
    s, w = make("off")
    heavy = [request(i, "heavy", arrival=float(i)) for i in range(1, 101)]
    light = [request(1000 + i, "light", arrival=200.0 + i) for i in range(10)]
    for r in heavy + light:
        s.add_request(r)
    assert share_while_both_busy(s, w, heavy + light, "light", "heavy") < 0.3


def test_a_weight_two_tenant_gets_about_twice_the_share() -> None:
    s, w = make(weights=(("gold", 2.0),))
    gold = [request(i, "gold", arrival=float(i)) for i in range(1, 41)]
    plain = [request(1000 + i, "plain", arrival=float(i)) for i in range(1, 41)]
    for r in gold + plain:
        s.add_request(r)
    share = share_while_both_busy(s, w, gold + plain, "gold", "plain")
    assert 0.6 <= share <= 0.72      # 2/3, give or take a request's tokens


def test_returning_from_idle_banks_no_credit() -> None:
    s, w = make(max_num_seqs=2)
    a = [request(i, "a", arrival=float(i)) for i in range(1, 41)]
    for r in a:
        s.add_request(r)
    for _ in range(30):               # a alone: its counter runs ahead
        drive_step(s, w)
    fairness = s.fairness
    assert fairness is not None and fairness.service("a") > 100
    b = [request(1000 + i, "b", arrival=100.0 + i) for i in range(20)]
    s.add_request(b[0])
    assert fairness.service("b") == fairness.service("a")    # lifted to the least active counter
    for r in b[1:]:
        s.add_request(r)
    share = share_while_both_busy(s, w, a + b, "b", "a")
    assert 0.45 <= share <= 0.55      # not the whole server while it "catches up"


def test_an_idle_tenant_keeps_its_debt_and_newcomers_start_at_the_floor() -> None:
    f = TenantFairness()
    first = request(1, "a")
    f.arrive(first)
    f.charge(first, 0, 8)
    f.charge(first, 8, 2)                     # two output positions
    assert f.service("a") == 8 * PROMPT_TOKEN_WEIGHT + 2 * OUTPUT_TOKEN_WEIGHT
    f.leave(first)                            # a is idle, nobody active: the floor is a's
    assert f.floor == f.service("a")
    newcomer = request(2, "b")
    f.arrive(newcomer)
    assert f.service("b") == f.service("a")   # no credit for never having asked
    again = request(3, "a")
    f.charge(newcomer, 0, 8)
    f.arrive(again)                           # a comes back: lifted to b's, the least active
    assert f.service("a") == f.service("b")


def test_each_position_is_charged_once() -> None:
    f = TenantFairness({"x": 2.0})
    r = request(1, "x", prompt=8)
    f.arrive(r)
    f.charge(r, 4, 4)                 # its first chunk starts past a 4-token cached prefix: free
    f.charge(r, 8, 1)
    assert f.service("x") == (4 * PROMPT_TOKEN_WEIGHT + OUTPUT_TOKEN_WEIGHT) / 2
    f.charge(r, 0, 9)                 # recomputed after a preemption: not charged again
    f.charge(r, 11, 1)                # positions 9 and 10 were accepted drafts: charged now
    assert f.service("x") == (4 * PROMPT_TOKEN_WEIGHT + 4 * OUTPUT_TOKEN_WEIGHT) / 2
    (row,) = f.report([r], [])
    assert (row.tenant, row.prompt_tokens, row.output_tokens, row.waiting, row.running) == ("x", 4, 4, 1, 0)


def test_idle_tenants_beyond_the_bound_are_forgotten_least_served_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fairness_module, "MAX_IDLE_TENANTS", 3)
    f = TenantFairness()
    busy = request(100, "busy")
    f.arrive(busy)
    f.charge(busy, 0, 8)                       # busy stays active throughout
    for i in range(6):                         # one-off tenants, served i positions each
        r = request(i, f"user-{i}")
        f.arrive(r)
        f.charge(r, 0, i)
        f.leave(r)
    # (the bound is applied as a tenant arrives: at user-5's, users 0 and 1 went)
    names = {row.tenant for row in f.report([], [busy])}
    assert names == {"busy", "user-2", "user-3", "user-4", "user-5"}
    assert f.service("user-1") == f.floor == 8.0       # forgotten: back at the floor (busy's)


# -- priority and preemption -------------------------------------------------------------------


def test_priority_orders_within_a_tenant_never_across() -> None:
    s, w = make(max_num_seqs=1)
    first = request(1, "b", max_tokens=12, arrival=0.0)
    s.add_request(first)
    drive_step(s, w)                                   # b rides alone
    low_a = request(2, "a", priority=0, arrival=1.0)
    high_a = request(3, "a", priority=5, arrival=2.0)
    urgent_b = request(4, "b", priority=10, arrival=0.5)
    for r in (low_a, high_a, urgent_b):
        s.add_request(r)                               # a is lifted to b's counter, then b runs ahead
    boarded = []
    while s.has_work():
        output, _ = drive_step(s, w)
        boarded += [r.seq_id for r in output.new_seqs]
    # a is the least served when the seat frees: its own highest priority first;
    # b's priority 10 does not jump over a.
    assert boarded[0] == 3 and boarded.index(3) < boarded.index(2)
    assert boarded[1] == 4        # then b, behind on service again after a's request


def test_off_ignores_tenants_exactly() -> None:
    """--fairness off: the same plans with or without tenants (today's order)."""
    def plans(tenants: bool) -> list[list[tuple[int, int, int]]]:
        s, w = make("off", max_num_seqs=3, num_blocks=20, max_model_len=40)
        for i, (priority, arrival) in enumerate([(0, 3.0), (2, 5.0), (1, 1.0), (1, 1.0), (0, 0.0),
                                                  (3, 9.0), (0, 2.0)], 1):
            s.add_request(request(i, f"t{i % 2}" if tenants else "", prompt=6 + i, max_tokens=6,
                                  priority=priority, arrival=arrival))
        steps = [[(c.request.seq_id, c.start_position, c.num_new_tokens) for c in out.scheduled]
                 for out in run_until_idle(s, w)]
        assert s.fairness is None and s.tenant_report() == []
        return steps
    assert plans(True) == plans(False)


@pytest.mark.parametrize("fairness, victim_tenant", [("off", "light"), ("tenant", "heavy")])
def test_preemption_takes_the_most_served_tenant_first(fairness: str, victim_tenant: str) -> None:
    # 7 blocks of 4: heavy's 16-token prompt and light's 4 fill 5; the decodes take the rest.
    s, w = make(fairness, num_blocks=7, max_model_len=28, max_num_seqs=2, max_num_batched_tokens=32)
    heavy = request(1, "heavy", prompt=16, max_tokens=12, priority=0, arrival=0.0)
    light = request(2, "light", prompt=4, max_tokens=12, priority=0, arrival=1.0)
    s.add_request(heavy)
    s.add_request(light)
    preempted: list[Request] = []
    while not preempted:
        output, _ = drive_step(s, w)
        preempted = output.preempted
    # off: the latest arrival (light); tenant: the most served (heavy), though it came first
    assert [r.tenant for r in preempted] == [victim_tenant]
    run_until_idle(s, w)
    for r in (heavy, light):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)


def test_a_light_tenant_takes_a_seat_from_a_flood_holding_them_all() -> None:
    def first_light_step(fairness: str) -> tuple[int, list[str]]:
        s, w = make(fairness, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True)
        heavy = [request(i, "heavy", prompt=8, max_tokens=30, arrival=float(i)) for i in range(1, 7)]
        for r in heavy:
            s.add_request(r)
        for _ in range(3):
            drive_step(s, w)
        assert s.num_running == 4
        light = request(100, "light", prompt=6, max_tokens=4, arrival=10.0)
        s.add_request(light)
        steps, preempted = 0, []
        while not light.output_token_ids:
            output, _ = drive_step(s, w)
            preempted += [r.tenant for r in output.preempted]
            steps += 1
        run_until_idle(s, w)
        for r in heavy + [light]:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)
        return steps, preempted

    # fair share: a heavy request gives up its seat at once; FCFS: the light one waits for a heavy to end
    assert first_light_step("tenant") == (1, ["heavy"])
    steps, preempted = first_light_step("off")
    assert steps > 20 and preempted == []


def test_tenants_at_their_seat_shares_take_no_seats_from_each_other() -> None:
    s, w = make(max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True)
    requests = [request(i, tenant, prompt=8, max_tokens=12, arrival=float(i))
                for i in range(1, 41) for tenant in ["a" if i % 2 else "b"]]
    for r in requests:
        s.add_request(r)
    steps = preemptions = 0
    while s.has_work():
        output, _ = drive_step(s, w)
        steps += 1
        preemptions += len(output.preempted)
        waiting = {r.tenant for r in requests if r.status is RequestStatus.WAITING}
        if waiting == {"a", "b"} and s.num_running == 4:     # both queued, seats full: neither holds all
            held = Counter(r.tenant for r in requests if r.status is RequestStatus.RUNNING)
            assert set(held) == {"a", "b"}, held
    # a seat moves only when a finish tips the split to 3-1, never a step-by-step swap
    assert preemptions <= len(requests) // 2 and steps > 4 * preemptions
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)


@pytest.mark.parametrize("fairness, light_tokens", [("tenant", 8), ("off", 0)])
def test_a_flood_prompt_leaves_a_light_prompt_its_share_of_the_step(fairness: str, light_tokens: int) -> None:
    s, w = make(fairness, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    heavy = request(1, "heavy", prompt=100, max_tokens=2, arrival=0.0)
    s.add_request(heavy)
    drive_step(s, w)                      # heavy's prompt is chunked: 16 of 100
    light = request(2, "light", prompt=8, max_tokens=2, arrival=1.0)
    s.add_request(light)
    output, _ = drive_step(s, w)
    got = {c.request.tenant: c.num_new_tokens for c in output.scheduled}
    assert got.get("light", 0) == light_tokens and got["heavy"] == 16 - light_tokens
    run_until_idle(s, w)
    for r in (heavy, light):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)


# -- tenants and weights: sources and bounds ----------------------------------------------------


@pytest.mark.parametrize("tenant, ok", [("", True), ("team-a/alice@example.com", True), ("é漢", True),
                                        ("x" * MAX_TENANT_CHARS, True), ("x" * (MAX_TENANT_CHARS + 1), False),
                                        ("tab\there", False), ("new\nline", False),
                                        ("jitney:other", False)])
def test_tenant_bounds(tenant: str, ok: bool) -> None:
    assert (tenant_problem(tenant) is None) is ok


def test_key_file_weights_and_old_lines() -> None:
    keys, _ = parse_api_keys(f"{ALICE}\nbob:{BOB}:2.5\ncarol:with:colons-{BOB}\ndave:{ALICE}x:1\n")
    assert keys.names == ["key-1", "bob", "carol", "dave"]
    assert keys.weights == {"bob": 2.5, "dave": 1.0}
    assert keys.identify(BOB) == "bob"                       # the weight is not part of the key
    assert keys.identify(f"with:colons-{BOB}") == "carol"    # an old key holding ':' still is one
    assert keys.identify(f"{ALICE}x") == "dave"


@pytest.mark.parametrize("line", [f"bob:{BOB}:0", f"bob:{BOB}:-1", f"bob:{BOB}:1e9", f"bob:{BOB}:2.5.1",
                                  f"bob:{BOB}:nan"])
def test_a_bad_key_weight_is_a_start_up_error(line: str) -> None:
    with pytest.raises(SecurityError, match="line 1: key 'bob': a tenant weight is a number") as err:
        parse_api_keys(line + "\n")
    assert BOB not in str(err.value)


def test_weights_of_the_flag_and_the_key_file() -> None:
    keys, _ = parse_api_keys(f"bob:{BOB}:2\nalice:{ALICE}\n")
    security = ServerSecurity(keys=keys)

    def cfg(**fields: Any) -> SchedulerProcessConfig:
        return SchedulerProcessConfig(None, "127.0.0.1", 1, None, None, "continuous", "ipc://a", "ipc://b",
                                      **fields)
    assert tenant_weight("team=a=3") == ("team=a", 3.0)
    for bad in ("noweight", "=2", "x=0", "x=abc"):
        with pytest.raises(ValueError):
            tenant_weight(bad)
    assert cfg(fairness="tenant", tenant_weights=(("carol", 4.0),)).weights(security) == (
        ("bob", 2.0), ("carol", 4.0))
    assert cfg().weights(security) == ()                    # off: the key file's weights are unused
    with pytest.raises(ValueError, match="needs --fairness tenant"):
        cfg(tenant_weights=(("carol", 4.0),)).weights(security)
    with pytest.raises(ValueError, match="weight already"):
        cfg(fairness="tenant", tenant_weights=(("bob", 4.0),)).weights(security)
    with pytest.raises(ValueError, match="two weights"):
        cfg(fairness="tenant", tenant_weights=(("c", 1.0), ("c", 2.0))).weights(security)
    with pytest.raises(ValueError, match="fairness must be one of"):
        make("fair")


# -- end to end: two API keys ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fair_server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.support.in_process_scheduler import InProcessScheduler

    folder = tmp_path_factory.mktemp("fair")
    keys = folder / "keys.txt"
    keys.write_text(f"alice:{ALICE}\nbob:{BOB}:2\n")
    server = InProcessScheduler(folder, model, None, api_key_file=str(keys), fairness="tenant",
                                metrics_port=free_port())
    yield server
    server.close()


def _generate(server: Any, key: str, **params: Any) -> None:
    server.stub(key).Generate(pb.GenerateRequest(params=pb.GenerationParams(
        text="hello jitney", sampling=pb.SamplingParams(max_tokens=3), **params)), timeout=TIMEOUT)


def test_the_key_name_is_the_tenant(fair_server: Any) -> None:
    for key in (ALICE, BOB, BOB):
        _generate(fair_server, key, tenant="ignored-when-keys-are-on")
    for tenant in ("alice", "bob"):
        assert fair_server.metric("jitney:tenant_computed_tokens", tenant=tenant, kind="prompt") > 0
        assert fair_server.metric("jitney:tenant_computed_tokens", tenant=tenant, kind="output") > 0
        assert fair_server.metric("jitney:tenant_requests_waiting", tenant=tenant) == 0
    assert fair_server.metric("jitney:tenant_service", tenant="ignored-when-keys-are-on") == 0
    # bob came when alice had left (lifted to her counter), then his tokens count half (weight 2)
    alice, bob = (fair_server.metric("jitney:tenant_service", tenant=t) for t in ("alice", "bob"))
    prompt, output = (fair_server.metric("jitney:tenant_computed_tokens", tenant="bob", kind=k)
                      for k in ("prompt", "output"))
    assert bob == pytest.approx(alice + (PROMPT_TOKEN_WEIGHT * prompt + OUTPUT_TOKEN_WEIGHT * output) / 2)


def test_a_bad_tenant_is_refused_in_each_door_s_shape(fair_server: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _generate(fair_server, ALICE, tenant="x" * (MAX_TENANT_CHARS + 1))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "params.tenant" in str(err.value.details())
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "user": "bad\u0007user",
                       "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{fair_server.http_port}/v1/chat/completions", data=body,
                                 headers={"authorization": f"Bearer {ALICE}", "content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=TIMEOUT)
    assert http_err.value.code == 400
    error = json.loads(http_err.value.read())["error"]
    assert error["param"] == "user" and "printable" in error["message"]


def test_each_http_door_carries_its_user_as_the_tenant() -> None:
    from jitney.scheduler.api.http.anthropic.protocol import parse_messages_request
    from jitney.scheduler.api.http.openai.protocol import APIError, parse_request
    from jitney.scheduler.api.http.openai_responses.protocol import parse_create

    messages = [{"role": "user", "content": "hi"}]
    assert parse_request({"messages": messages, "user": "carol"}, chat=True).params.tenant == "carol"
    assert parse_request({"prompt": "hi", "user": "dan"}, chat=False).params.tenant == "dan"
    assert parse_request({"prompt": "hi"}, chat=False).params.tenant == ""
    responses = parse_create({"input": "hi", "user": "erin"}).chat_args
    assert parse_request(dict(responses, messages=messages), chat=True).params.tenant == "erin"
    anthropic = parse_messages_request({"model": "m", "max_tokens": 4, "messages": messages,
                                        "metadata": {"user_id": "frank"}})
    assert parse_request(anthropic.chat, chat=True).params.tenant == "frank"
    with pytest.raises(APIError) as err:
        parse_request({"messages": messages, "user": "x" * (MAX_TENANT_CHARS + 1)}, chat=True)
    assert err.value.param == "user" and "more than the limit 256" in str(err.value)
    assert anthropic.param("user") == "metadata.user_id"     # how the Anthropic door names that error
