"""TLS and API keys on the scheduler's doors (scheduler/security/tls.py, scheduler/security/keys.py,
client/channel.py).

Most tests run the real `jitney scheduler` (``scheduler.main.serve``: the
gRPC server with its credentials and interceptor, the OpenAI door, the
engine) in a background event loop of this process, with the scripted
worker (``tests/support/scripted_worker.py``) on its ZeroMQ sockets: two
servers per module, one plaintext and one with mutual TLS, both with API
keys. Certificates (a CA, a server certificate for 127.0.0.1 / localhost,
client certificates) are made at test time (conftest.py). The flags, the key
file and the real `jitney serve` are in test_security_flags.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.support.certs import Pki
from tests.support.in_process_scheduler import InProcessScheduler, health_status as _health
from tests.support.security_keys import ALICE, BOB, PROMPT, TIMEOUT, WRONG
from tests.support.server_harness import free_port
from tests.support.waiting import wait_for
from jitney.client.channel import TlsFiles, open_aio_channel, open_channel
from jitney.scheduler.security.keys import UNAUTHENTICATED_MESSAGE, KeyLimiter, KeyLimitError
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc

PER_KEY = 2                          # --max-requests-per-key


@pytest.fixture(scope="module")
def plain(model: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessScheduler]:
    """Plaintext, API keys, --max-requests-per-key 2, --log-prompts, --metrics-port."""
    server = InProcessScheduler(tmp_path_factory.mktemp("plain"), model, None, api_key_file=str(key_file),
                                max_requests_per_key=PER_KEY, log_prompts=True, metrics_port=free_port())
    yield server
    server.close()


@pytest.fixture(scope="module")
def mtls(model: Path, key_file: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[InProcessScheduler]:
    """Mutual TLS and API keys; clients show the CA's client certificate."""
    server = InProcessScheduler(tmp_path_factory.mktemp("mtls"), model,
                                TlsFiles(pki.ca, pki.client_cert, pki.client_key),
                                tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                tls_client_ca=str(pki.ca), api_key_file=str(key_file))
    yield server
    server.close()


@pytest.fixture
def slow_worker(plain: InProcessScheduler) -> Iterator[None]:
    plain.worker.step_seconds = 0.02
    yield
    plain.worker.step_seconds = 0.0
    _wait_idle(plain)


def _wait_idle(server: InProcessScheduler) -> None:
    stub = server.stub(ALICE)
    wait_for(lambda: _running(stub) == (0, 0), what="requests still in flight")


def _running(stub: pb_grpc.GenerationServiceStub) -> tuple[int, int]:
    stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=TIMEOUT)
    return stats.requests_running, stats.requests_waiting


def _params(max_tokens: int = 4, text: str = "hello jitney", **sampling: Any) -> pb.GenerationParams:
    return pb.GenerationParams(text=text, sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **sampling))


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()  # type: ignore[no-any-return]


CALLS = {
    "Generate": lambda s: s.Generate(pb.GenerateRequest(params=_params()), timeout=TIMEOUT),
    "GenerateStream": lambda s: list(s.GenerateStream(pb.GenerateStreamRequest(params=_params()),
                                                      timeout=TIMEOUT)),
    "Tokenize": lambda s: s.Tokenize(pb.TokenizeRequest(text="hello"), timeout=TIMEOUT),
    "GetModelInfo": lambda s: s.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT),
    "GetServerStats": lambda s: s.GetServerStats(pb.GetServerStatsRequest(), timeout=TIMEOUT),
    "LoadLoraAdapter": lambda s: s.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="a", lora_path="/x"),
                                                   timeout=TIMEOUT),
    "UnloadLoraAdapter": lambda s: s.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="a"),
                                                       timeout=TIMEOUT),
}


# -- API keys on the gRPC port ---------------------------------------------------


def test_every_method_needs_a_key_and_one_message_for_missing_and_wrong(plain: InProcessScheduler) -> None:
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert sorted(CALLS) == sorted(m.name for m in service.methods)   # a new method gets a case here
    for name, call in CALLS.items():
        for key in (None, WRONG, ALICE.upper()):
            with pytest.raises(grpc.RpcError) as err:
                call(plain.stub(key))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, key)
            assert err.value.details() == UNAUTHENTICATED_MESSAGE


def test_a_malformed_authorization_is_unauthenticated(plain: InProcessScheduler) -> None:
    stub = plain.stub()
    for value in (ALICE, f"Basic {ALICE}", "Bearer", f"Bearer  {WRONG}"):
        assert _code(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT,
                                               metadata=[("authorization", value)])) \
            == grpc.StatusCode.UNAUTHENTICATED, value
    # the scheme is case-insensitive, as HTTP's
    stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT, metadata=[("authorization", f"bearer {BOB}")])


def test_the_right_key_generates(plain: InProcessScheduler) -> None:
    stub = plain.stub(ALICE)
    reply = stub.Generate(pb.GenerateRequest(params=_params(5)), timeout=TIMEOUT)
    assert len(reply.token_ids) == 5 and reply.text
    streamed = list(plain.stub(BOB).GenerateStream(pb.GenerateStreamRequest(params=_params(5)),
                                                   timeout=TIMEOUT))
    assert sum(len(m.token_ids) for m in streamed) == 5
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT).vocab_size == 320
    assert stub.GetServerStats(pb.GetServerStatsRequest(), timeout=TIMEOUT).kv_blocks_total > 0


def test_asyncio_channels_carry_the_key_on_every_kind_of_call(plain: InProcessScheduler) -> None:
    async def calls() -> tuple[int, int]:
        async with open_aio_channel(plain.target, api_key=BOB) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
            tokens = 0
            async for msg in stub.GenerateStream(pb.GenerateStreamRequest(params=_params(3)), timeout=TIMEOUT):
                tokens += len(msg.token_ids)
            return info.vocab_size, tokens

    assert asyncio.run(calls()) == (320, 3)


def test_health_and_reflection_answer_without_a_key(plain: InProcessScheduler) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert _health(plain.target, None) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(plain.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT)))
    assert "jitney.v1.GenerationService" in [s.name for s in reply.list_services_response.service]


def test_metrics_count_requests_per_key_name(plain: InProcessScheduler) -> None:
    before = plain.metric("jitney:request_success_total", finished_reason="length", key="bob", door="grpc")
    refused = plain.metric("jitney:request_failure_total", code="UNAUTHENTICATED", key="", door="grpc")
    plain.stub(BOB).Generate(pb.GenerateRequest(params=_params(2)), timeout=TIMEOUT)
    _code(lambda: CALLS["GetServerStats"](plain.stub(WRONG)))
    assert plain.metric("jitney:request_success_total", finished_reason="length", key="bob",
                        door="grpc") == before + 1
    assert plain.metric("jitney:request_failure_total", code="UNAUTHENTICATED", key="", door="grpc") == refused + 1
    assert plain.metric("jitney:generation_tokens_total", key="bob", door="grpc") >= 2
    # the OpenAI door's health is open too
    text = urllib.request.urlopen(f"http://127.0.0.1:{plain.http_port}/health", timeout=TIMEOUT).read()
    assert json.loads(text) == {"status": "serving"}


# -- the per-key limit -------------------------------------------------------------


def _open_stream(stub: pb_grpc.GenerationServiceStub, timeout: float = 30.0) -> Any:
    """A long stream, once its first message has come (it holds a slot)."""
    call = stub.GenerateStream(pb.GenerateStreamRequest(params=_params(400)), timeout=timeout)
    next(call)
    return call


def _assert_key_has_slots(server: InProcessScheduler, key: str) -> None:
    """The key can again hold PER_KEY requests (a slot freed late is waited for), and no more."""
    stub = server.stub(key)
    calls: list[Any] = []
    try:
        deadline = time.monotonic() + 10
        while len(calls) < PER_KEY:
            try:
                calls.append(_open_stream(stub))
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert time.monotonic() < deadline, f"{key[:5]}'s slots were not given back"
                time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            _open_stream(stub)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-requests-per-key {PER_KEY}" in (err.value.details() or "")
    finally:
        for call in calls:
            call.cancel()


@pytest.mark.usefixtures("slow_worker")
def test_per_key_limit_refuses_the_next_and_frees_on_cancel(plain: InProcessScheduler) -> None:
    bob = plain.stub(BOB)
    held = [_open_stream(bob) for _ in range(PER_KEY)]
    assert _code(lambda: _open_stream(bob)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    _open_stream(plain.stub(ALICE)).cancel()          # other keys are not held back
    held.pop().cancel()
    wait_for(lambda: _can_open(bob), what="a cancelled stream kept its slot")
    for call in held:
        call.cancel()
    _assert_key_has_slots(plain, BOB)


def _can_open(stub: pb_grpc.GenerationServiceStub) -> bool:
    try:
        _open_stream(stub).cancel()
        return True
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False


@pytest.mark.usefixtures("slow_worker")
def test_every_way_a_request_ends_gives_its_slot_back(plain: InProcessScheduler) -> None:
    stub = plain.stub(BOB)
    # finished (unary and stream)
    stub.Generate(pb.GenerateRequest(params=_params(3)), timeout=TIMEOUT)
    list(stub.GenerateStream(pb.GenerateStreamRequest(params=_params(3)), timeout=TIMEOUT))
    # refused by validation: never takes a slot
    for _ in range(PER_KEY + 1):
        assert _code(lambda: stub.Generate(pb.GenerateRequest(params=_params(3, temperature=-1.0)),
                                           timeout=TIMEOUT)) == grpc.StatusCode.INVALID_ARGUMENT
    # past the call's deadline
    assert _code(lambda: list(stub.GenerateStream(pb.GenerateStreamRequest(params=_params(400)),
                                                  timeout=0.5))) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _code(lambda: stub.Generate(pb.GenerateRequest(params=_params(400)), timeout=0.5)) \
        == grpc.StatusCode.DEADLINE_EXCEEDED
    # the client goes away: a process killed in the middle of a stream, a channel
    # closed under a unary call
    _killed_while_streaming(plain.target, BOB)
    wait_for(lambda: _running(plain.stub(ALICE)) == (0, 0), what="the killed client's stream still runs")
    gone = open_channel(plain.target, api_key=BOB)
    future = pb_grpc.GenerationServiceStub(gone).Generate.future(pb.GenerateRequest(params=_params(400)),
                                                                 timeout=30)
    wait_for(lambda: _running(plain.stub(ALICE)) == (1, 0), what="the unary call is not running")
    gone.close()
    assert future.exception() is not None
    _assert_key_has_slots(plain, BOB)


def _killed_while_streaming(target: str, key: str) -> None:
    code = ("import os\n"
            "from jitney.client.channel import open_channel\n"
            "from jitney.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc\n"
            "stub = pb_grpc.GenerationServiceStub(open_channel(os.environ['TARGET'], api_key=os.environ['KEY']))\n"
            "params = pb.GenerationParams(text='hi', sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True))\n"
            "next(stub.GenerateStream(pb.GenerateStreamRequest(params=params)))\n"
            "print('streaming', flush=True)\n"
            "input()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "TARGET": target, "KEY": key})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"streaming\n"
    finally:
        proc.kill()
        proc.wait()


def test_key_limiter_unit() -> None:
    limiter = KeyLimiter(1)
    release = limiter.acquire("a")
    with pytest.raises(KeyLimitError, match="--max-requests-per-key 1"):
        limiter.acquire("a")
    limiter.acquire("b")
    release()
    release()                     # twice is once
    assert limiter.in_flight("a") == 0
    limiter.acquire("a")
    assert KeyLimiter(None).acquire("a") is KeyLimiter(None).acquire(None)   # unlimited: no count


# -- TLS -----------------------------------------------------------------------------


def test_tls_client_against_a_plaintext_server_fails_cleanly(plain: InProcessScheduler, pki: Pki) -> None:
    start = time.monotonic()
    assert _code(lambda: plain.stub(ALICE, tls=TlsFiles(pki.ca)).GetModelInfo(
        pb.GetModelInfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 5
    assert plain.stub(ALICE).Generate(pb.GenerateRequest(params=_params(2)), timeout=TIMEOUT).token_ids


def test_plaintext_client_against_a_tls_server_fails_cleanly(mtls: InProcessScheduler) -> None:
    start = time.monotonic()
    assert _code(lambda: mtls.stub(ALICE, tls=None).GetModelInfo(
        pb.GetModelInfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    assert _health(mtls.target, None) is None
    assert time.monotonic() - start < 10
    assert mtls.stub(ALICE).Generate(pb.GenerateRequest(params=_params(2)), timeout=TIMEOUT).token_ids


def test_mutual_tls_needs_a_client_certificate_of_the_ca(mtls: InProcessScheduler, pki: Pki) -> None:
    for tls in (TlsFiles(pki.ca), TlsFiles(pki.ca, pki.stranger_cert, pki.stranger_key)):
        assert _code(lambda: mtls.stub(ALICE, tls=tls).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # with the certificate: health without a key, the rest with one
    assert _health(mtls.target, mtls.tls) == health_pb2.HealthCheckResponse.SERVING
    assert _code(lambda: CALLS["GetServerStats"](mtls.stub())) == grpc.StatusCode.UNAUTHENTICATED
    reply = mtls.stub(BOB).Generate(pb.GenerateRequest(params=_params(3)), timeout=TIMEOUT)
    assert len(reply.token_ids) == 3


# -- the OpenAI door ------------------------------------------------------------------


def _http(url: str, key: str | None, context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    body = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, body, headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_openai_door_wants_the_same_keys(plain: InProcessScheduler) -> None:
    url = f"http://127.0.0.1:{plain.http_port}/v1/completions"
    refused = plain.metric("jitney:request_failure_total", code="UNAUTHENTICATED", door="openai")
    served = plain.metric("jitney:request_success_total", key="alice", door="openai")
    served_grpc = plain.metric("jitney:request_success_total", key="alice", door="grpc")
    for key in (None, WRONG):
        status, body = _http(url, key)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
    status, body = _http(url, ALICE)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    # Counted under the door they came through.
    assert plain.metric("jitney:request_failure_total", code="UNAUTHENTICATED", door="openai") == refused + 2
    assert plain.metric("jitney:request_success_total", key="alice", door="openai") == served + 1
    assert plain.metric("jitney:request_success_total", key="alice", door="grpc") == served_grpc
    assert plain.metric("jitney:generation_tokens_total", key="alice", door="openai") >= 3


@pytest.mark.usefixtures("slow_worker")
def test_openai_door_shares_the_per_key_limit(plain: InProcessScheduler) -> None:
    bob = plain.stub(BOB)
    held = [_open_stream(bob) for _ in range(PER_KEY)]
    try:
        status, body = _http(f"http://127.0.0.1:{plain.http_port}/v1/completions", BOB)
        assert status == 429 and "--max-requests-per-key" in body["error"]["message"]
    finally:
        for call in held:
            call.cancel()


def test_openai_door_speaks_https_with_the_client_ca(mtls: InProcessScheduler, pki: Pki) -> None:
    url = f"https://127.0.0.1:{mtls.http_port}/v1/completions"
    context = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
        _http(url, ALICE, context)               # no client certificate
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    assert _http(url, None, context)[0] == 401
    status, body = _http(url, ALICE, context)
    assert status == 200 and body["usage"]["completion_tokens"] == 3


# -- logs -------------------------------------------------------------------------------


def test_logs_name_the_key_never_show_it(plain: InProcessScheduler, caplog: pytest.LogCaptureFixture) -> None:
    """--log-prompts is on here: the prompt is in the request line, the key never is."""
    caplog.set_level(logging.DEBUG)
    plain.stub(ALICE).Generate(pb.GenerateRequest(params=_params(3, text=PROMPT)), timeout=TIMEOUT)
    _code(lambda: plain.stub(WRONG).Generate(pb.GenerateRequest(params=_params(3, text=PROMPT)),
                                             timeout=TIMEOUT))
    _http(f"http://127.0.0.1:{plain.http_port}/v1/completions", WRONG)
    wait_for(lambda: any("key=alice" in r.getMessage() for r in caplog.records), what="no request line")
    text = "\n".join(r.getMessage() for r in caplog.records)
    line = next(r.getMessage() for r in caplog.records if "key=alice" in r.getMessage())
    assert "finish=length" in line and PROMPT in line
    assert "rejected UNAUTHENTICATED" in text and "rejected 401" in text
    for secret in (ALICE, WRONG, ALICE[-16:], WRONG[-16:]):
        assert secret not in text
