"""TLS and API keys on the scheduler's doors (scheduler/security.py, scheduler/auth.py,
client/channel.py).

Most tests run the real `jitney scheduler` (``scheduler.main.serve``: the
gRPC server with its credentials and interceptor, the OpenAI door, the
engine) in a background event loop of this process, with the scripted
worker of ``test_openai_api`` on its ZeroMQ sockets: two servers per module,
one plaintext and one with mutual TLS, both with API keys. One test runs the
real `jitney serve` on a tiny random model, to see the flags reach the
scheduler process and to read everything its processes print. Certificates
(a CA, a server certificate for 127.0.0.1 / localhost, client certificates)
are made at test time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.certs import Pki, make_pki
from bench.server_harness import free_port, running_server
from jitney.client.channel import TlsFiles, open_aio_channel, open_channel
from jitney.common.model_files import load_tokenizer, resolve_model
from jitney.scheduler.auth import UNAUTHENTICATED_MESSAGE, KeyLimiter, KeyLimitError, bearer_token
from jitney.scheduler.main import SchedulerProcessConfig, serve
from jitney.scheduler.security import (SecurityError, ServerSecurity, check_flags, exposure_warning,
                                       load_security, parse_api_keys)
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from test_openai_api import ScriptedWorker, serve_worker

ALICE = "alice-0123456789abcdef0123456789abcdef"
BOB = "bob-fedcba9876543210fedcba9876543210"
WRONG = "mallory-00000000000000000000000000000"
PER_KEY = 2                          # --max-requests-per-key
PROMPT = "zebra quokka passphrase xylophone"     # distinctive: searched for in the logs
TIMEOUT = 10.0


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# the test's keys\nalice:{ALICE}\n\nbob:{BOB}\n")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)


# -- the scheduler in this process -----------------------------------------------


class InProcessScheduler:
    """``serve(cfg)`` in a background loop, the scripted worker on its sockets."""

    def __init__(self, folder: Path, model: Path, client_tls: TlsFiles | None, **fields: Any) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.tls = client_tls
        self.cfg = SchedulerProcessConfig(str(model), "127.0.0.1", self.port, None, None, "continuous",
                                          f"ipc://{folder}/plan", f"ipc://{folder}/result",
                                          openai_port=self.http_port, drain_seconds=1.0, **fields)
        self.worker = ScriptedWorker(load_tokenizer(resolve_model(model)))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop: asyncio.Event | None = None
        self._channels: dict[tuple[str | None, TlsFiles | None], grpc.Channel] = {}
        self.served = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        deadline = time.monotonic() + 60
        while _health(self.target, self.tls) != health_pb2.HealthCheckResponse.SERVING:
            assert not self.served.done(), f"serve() ended: {self.served.result()}"
            assert time.monotonic() < deadline, "the in-process scheduler is not SERVING"
            time.sleep(0.05)

    async def _run(self) -> int:
        self.stop = asyncio.Event()
        link = SimpleNamespace(plan_addr=self.cfg.plan_addr, result_addr=self.cfg.result_addr)
        worker = asyncio.create_task(serve_worker(link, self.worker))   # type: ignore[arg-type]
        try:
            return await serve(self.cfg, stop=self.stop, drain=asyncio.Event())
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    def stub(self, key: str | None = None, tls: TlsFiles | None | str = "same") -> pb_grpc.GenerationServiceStub:
        """A stub on a channel with ``key`` and ``tls`` (default: the server's own)."""
        how = (key, self.tls if isinstance(tls, str) else tls)
        if how not in self._channels:
            self._channels[how] = open_channel(self.target, tls=how[1], api_key=key)
        return pb_grpc.GenerationServiceStub(self._channels[how])

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.cfg.metrics_port}/metrics",
                                      timeout=TIMEOUT).read().decode()
        want = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want + " "))

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        try:
            assert self.stop is not None
            self.loop.call_soon_threadsafe(self.stop.set)
            assert self.served.result(20) == 0
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def _health(target: str, tls: TlsFiles | None, timeout: float = 2.0) -> int | None:
    with open_channel(target, tls=tls) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout).status
        except grpc.RpcError:
            return None


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
    _until(lambda: _running(stub) == (0, 0), "requests still in flight")


def _running(stub: pb_grpc.GenerationServiceStub) -> tuple[int, int]:
    stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=TIMEOUT)
    return stats.requests_running, stats.requests_waiting


def _until(predicate: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


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
    before = plain.metric("jitney:request_success_total", finished_reason="length", key="bob")
    refused = plain.metric("jitney:request_failure_total", code="UNAUTHENTICATED", key="")
    plain.stub(BOB).Generate(pb.GenerateRequest(params=_params(2)), timeout=TIMEOUT)
    _code(lambda: CALLS["GetServerStats"](plain.stub(WRONG)))
    assert plain.metric("jitney:request_success_total", finished_reason="length", key="bob") == before + 1
    assert plain.metric("jitney:request_failure_total", code="UNAUTHENTICATED", key="") == refused + 1
    assert plain.metric("jitney:generation_tokens_total", key="bob") >= 2
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
    _until(lambda: _can_open(bob), "a cancelled stream kept its slot")
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
    _until(lambda: _running(plain.stub(ALICE)) == (0, 0), "the killed client's stream still runs")
    gone = open_channel(plain.target, api_key=BOB)
    future = pb_grpc.GenerationServiceStub(gone).Generate.future(pb.GenerateRequest(params=_params(400)),
                                                                 timeout=30)
    _until(lambda: _running(plain.stub(ALICE)) == (1, 0), "the unary call is not running")
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
    for key in (None, WRONG):
        status, body = _http(url, key)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
    status, body = _http(url, ALICE)
    assert status == 200 and body["usage"]["completion_tokens"] == 3


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
    _until(lambda: any("key=alice" in r.getMessage() for r in caplog.records), "no request line")
    text = "\n".join(r.getMessage() for r in caplog.records)
    line = next(r.getMessage() for r in caplog.records if "key=alice" in r.getMessage())
    assert "finish=length" in line and PROMPT in line
    assert "rejected UNAUTHENTICATED" in text and "rejected 401" in text
    for secret in (ALICE, WRONG, ALICE[-16:], WRONG[-16:]):
        assert secret not in text


# -- flags and the key file -----------------------------------------------------------


def test_key_file_names_comments_and_warnings() -> None:
    keys, warnings = parse_api_keys(f"# comment\n\n{ALICE}\nbob:{BOB}\n  ci.build-2 : short-key \n")
    assert keys.names == ["key-3", "bob", "ci.build-2"]
    assert keys.identify(ALICE) == "key-3" and keys.identify(BOB) == "bob"
    assert keys.identify("short-key") == "ci.build-2"
    assert keys.identify(WRONG) is None and keys.identify(None) is None and keys.identify("") is None
    assert len(warnings) == 1 and "'ci.build-2'" in warnings[0] and "short-key" not in warnings[0]


@pytest.mark.parametrize("text,error", [
    (f"a:{ALICE}\na:{BOB}\n", "line 2: the name 'a' is already used on line 1"),
    (f"a:{ALICE}\nb:{ALICE}\n", "line 2: the same key as line 1"),
    (f"{ALICE}\nkey-1:{BOB}\n", "line 2: the name 'key-1' is already used on line 1"),
    ("a:\n", "line 1: key 'a' is empty"),
    (f"a b:{ALICE}\n", "line 1: a key name is"),
    (f"a:{ALICE} extra\n", "line 1: a key is printable ASCII without spaces"),
    ("# nothing\n\n", "no keys"),
])
def test_key_file_errors_name_the_line_never_the_key(text: str, error: str) -> None:
    with pytest.raises(SecurityError) as err:
        parse_api_keys(text)
    assert error in str(err.value)
    assert ALICE not in str(err.value) and BOB not in str(err.value)


def test_flag_combinations_and_files(tmp_path: Path, pki: Pki, key_file: Path) -> None:
    for args, error in [((str(pki.server_cert), None, None, None, None), "go together"),
                        ((None, str(pki.server_key), None, None, None), "go together"),
                        ((None, None, str(pki.ca), None, None), "--tls-client-ca needs"),
                        ((None, None, None, None, 3), "needs --api-key-file")]:
        with pytest.raises(SecurityError, match=error):
            check_flags(*args)
    missing = str(tmp_path / "missing.pem")
    for args, error in [((missing, str(pki.server_key), None, None, None), "--tls-cert .*cannot read"),
                        ((str(pki.server_cert), str(pki.client_key), None, None, None),
                         "not a PEM certificate chain and the private key that matches it"),
                        ((str(pki.server_cert), str(key_file), None, None, None), "not a PEM file"),
                        ((None, None, None, missing, None), "--api-key-file .*cannot read")]:
        with pytest.raises(SecurityError, match=error):
            load_security(*args)
    security, warnings = load_security(str(pki.server_cert), str(pki.server_key), str(pki.ca),
                                       str(key_file), 4)
    assert security.tls is not None and security.tls.client_ca is not None and warnings == []


def test_jitney_serve_hands_the_flags_to_its_scheduler() -> None:
    from jitney.cli import build_parser
    from jitney.scheduler.supervisor import child_argv

    parser = build_parser()
    flags = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
             "--api-key-file", "keys.txt", "--max-requests-per-key", "3"]
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    argv = child_argv(sub["scheduler"], parser.parse_args(["serve", *flags]))
    cfg = SchedulerProcessConfig.from_namespace(parser.parse_args(["scheduler", *argv]))
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, cfg.api_key_file, cfg.max_requests_per_key) \
        == ("c.pem", "k.pem", "ca.pem", "keys.txt", 3)
    plain = SchedulerProcessConfig.from_namespace(parser.parse_args(["scheduler"]))
    assert (plain.tls_cert, plain.api_key_file, plain.max_requests_per_key) == (None, None, None)


def test_jitney_refuses_to_start_on_bad_security_flags(tmp_path: Path, pki: Pki,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from jitney.cli import main

    assert main(["serve", "--tls-cert", str(pki.server_cert)]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert main(["scheduler", "--api-key-file", str(tmp_path / "none")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_exposure_warning_for_plaintext_off_loopback() -> None:
    assert exposure_warning("127.0.0.1", ServerSecurity()) is None
    assert exposure_warning("localhost", ServerSecurity()) is None
    assert exposure_warning("::1", ServerSecurity()) is None
    assert "clear text" in (exposure_warning("0.0.0.0", ServerSecurity()) or "")
    assert bearer_token("Bearer  abc ") == "abc" and bearer_token("abc") is None


# -- real processes -----------------------------------------------------------------------


@pytest.mark.slow
def test_jitney_serve_with_tls_and_keys(model: Path, pki: Pki, tmp_path: Path) -> None:
    """`jitney serve` passes the flags to its scheduler; the client commands use
    TLS and keys; nothing either process prints shows the prompt, its token ids
    or a key (without --log-prompts), and the request line names the key."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{ALICE}\nshort:abc123\n")
    tls = TlsFiles(pki.ca)
    args = ["--model", str(model), "--num-blocks", "64", "--dtype", "float32", "--log-level", "debug",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--api-key-file", str(keys), "--max-requests-per-key", "4"]
    with running_server(args, tmp_path, tls=tls, api_key=ALICE) as server:
        cli = [sys.executable, "-m", "jitney.cli"]
        env = {**os.environ, "JITNEY_API_KEY": ALICE}
        health = subprocess.run([*cli, "health", "--target", server.target, "--tls-ca", str(pki.ca)],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
        generate = [*cli, "generate", PROMPT, "--target", server.target, "--tls-ca", str(pki.ca),
                    "--max-tokens", "4", "--ignore-eos"]
        ok = subprocess.run(generate, capture_output=True, text=True, timeout=60, env=env)
        assert ok.returncode == 0, ok.stderr
        refused = subprocess.run([*generate, "--api-key", WRONG], capture_output=True, text=True,
                                 timeout=60, env=env)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        ids = list(server.stub().Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=TIMEOUT).token_ids)
        _until(lambda: "key=alice" in server.log(), "no request line")
    log = server.log()
    assert "gRPC listening on" in log and "(TLS, 2 API keys, at most 4 in flight each;" in log
    assert log.count("'short'") == 1 and "abc123" not in log        # warned once, never shown
    assert "key=alice tokens in=" in log and "rejected UNAUTHENTICATED" in log
    for secret in (PROMPT, "quokka", ", ".join(map(str, ids)), " ".join(map(str, ids)), ALICE, WRONG):
        assert secret not in log, secret
