"""End to end over real processes and sockets, on a tiny random model.

`jitney serve` runs the scheduler and the worker as separate processes
linked by ZeroMQ; the test talks gRPC to it like any client.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.client.client import Sampling, make_params
from tests.support.server_harness import Server, health_status, running_server
from tests.support.tiny_models import make_tiny_llama
from tests.support.waiting import wait_idle

pytestmark = pytest.mark.slow

NUM_BLOCKS = 96
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)
    logs = tmp_path_factory.mktemp("logs")
    args = ["--model", str(model), "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--dtype", "float32"]
    with running_server(args, logs) as srv:
        yield srv


def ids_params(ids: list[int], max_tokens: int, **sampling) -> pb.GenerationParams:
    return make_params(ids, sampling=Sampling(max_tokens=max_tokens, ignore_eos=True, **sampling))


def stream_all(server: Server, params: pb.GenerationParams) -> list[pb.GenerateStreamResponse]:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return list(stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=120))


class StreamConsumer:
    """Reads a GenerateStream call on a thread, so a test can act while it runs."""

    def __init__(self, call: grpc.Call) -> None:
        self.call = call
        self.msgs: list[pb.GenerateStreamResponse] = []
        self.tokens = 0
        self.error: grpc.RpcError | None = None
        self.done = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:  # type: ignore[attr-defined]
                with self._changed:
                    self.msgs.append(msg)
                    self.tokens += len(msg.token_ids)
                    self._changed.notify_all()
        except grpc.RpcError as err:
            self.error = err
        finally:
            with self._changed:
                self.done = True
                self._changed.notify_all()

    def wait_for_tokens(self, count: int, timeout: float = 30.0) -> bool:
        """Block until ``count`` tokens have arrived (True) or the stream has
        ended short of them (False); fail on the timeout."""
        with self._changed:
            self._changed.wait_for(lambda: self.done or self.tokens >= count, timeout)
            assert self.done or self.tokens >= count, f"timed out waiting for {count} tokens, got {self.tokens}"
            return self.tokens >= count

    def result(self, timeout: float = 120.0) -> list[pb.GenerateStreamResponse]:
        self._thread.join(timeout)
        assert self.done, "the stream did not end"
        if self.error is not None:
            raise self.error
        return self.msgs


def test_health_reflection_and_model_info(server: Server) -> None:
    assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"jitney.v1.GenerationService", "grpc.health.v1.Health"} <= services
        svc = db.FindFileContainingSymbol("jitney.v1.GenerationService")
        assert svc.name == "jitney/v1/generation.proto"
    info = server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.num_kv_blocks, info.block_size) == (NUM_BLOCKS, BLOCK_SIZE)
    assert info.vocab_size > 0 and info.context_length > 0 and list(info.eos_token_ids)
    assert info.batch_invariant  # the CPU's default


def test_tokenize_and_unary_generate(server: Server) -> None:
    stub = server.stub()
    tok = stub.Tokenize(pb.TokenizeRequest(text="hello world"), timeout=10)
    assert len(tok.token_ids) == len(tok.tokens) > 0
    reply = stub.Generate(pb.GenerateRequest(params=ids_params(list(tok.token_ids), 9)), timeout=60)
    assert len(reply.token_ids) == len(reply.logprobs) == 9
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(tok.token_ids), 9)
    # The stream carries the same greedy tokens and text, one step per message.
    msgs = stream_all(server, ids_params(list(tok.token_ids), 9))
    assert [t for m in msgs for t in m.token_ids] == list(reply.token_ids)
    assert "".join(m.text for m in msgs) == reply.text
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])


def test_32_concurrent_streams_get_exactly_their_tokens(server: Server) -> None:
    jobs = [([(7 * i + j) % 200 + 3 for j in range(5 + 11 * i % 90)], 4 + (13 * i) % 40) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda job: stream_all(server, ids_params(*job)), jobs))
    for (prompt, max_tokens), msgs in zip(jobs, results):
        assert sum(len(m.token_ids) for m in msgs) == max_tokens
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert msgs[-1].usage.prompt_tokens == len(prompt)
    # Each result equals the same request run alone (greedy, batch-independent).
    alone = stream_all(server, ids_params(*jobs[5]))
    assert [t for m in alone for t in m.token_ids] == [t for m in results[5] for t in m.token_ids]
    assert wait_idle(server).kv_blocks_used == 0


def test_same_seed_same_output_whatever_the_batch(server: Server) -> None:
    params = ids_params([5, 6, 7, 8], 12, temperature=1.0, top_p=0.9, seed=1234)
    alone = [t for m in stream_all(server, params) for t in m.token_ids]
    with ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(stream_all, server, ids_params([9 + i] * (3 + i), 20, temperature=1.0))
                 for i in range(6)]
        batched = [t for m in stream_all(server, params) for t in m.token_ids]
        for f in noise:
            f.result()
    assert batched == alone
    other_seed = ids_params([5, 6, 7, 8], 12, temperature=1.0, top_p=0.9, seed=99)
    assert [t for m in stream_all(server, other_seed) for t in m.token_ids] != alone


def test_stop_string_ends_the_text_before_it(server: Server) -> None:
    base = server.stub().Generate(pb.GenerateRequest(params=ids_params([11, 12, 13], 24)), timeout=60)
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if len(stop.strip()) < 2:
        pytest.skip(f"the random model's text has no usable stop string: {text!r}")
    params = ids_params([11, 12, 13], 24)
    params.sampling.stop.append(stop)
    msgs = stream_all(server, params)
    got = "".join(m.text for m in msgs)
    assert got == text[: text.index(stop)]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE


def _invalid_cases(vocab: int, context: int) -> dict[str, tuple[pb.GenerationParams, str]]:
    def with_sampling(**kw) -> pb.GenerationParams:
        return make_params([1, 2, 3], sampling=Sampling(**kw))

    chat = pb.GenerationParams()
    chat.chat.messages.add(role="wizard", content="hi")
    return {
        "empty text": (pb.GenerationParams(text=""), "params"),
        "empty token ids": (pb.GenerationParams(token_ids=pb.TokenIds()), "params"),
        "no prompt": (pb.GenerationParams(), "params"),
        "empty chat": (pb.GenerationParams(chat=pb.ChatPrompt()), "params.chat"),
        "unknown role": (chat, "role"),
        "negative temperature": (with_sampling(temperature=-0.5), "temperature"),
        "top_p zero": (with_sampling(top_p=0.0), "top_p"),
        "top_p above one": (with_sampling(top_p=1.5), "top_p"),
        "token outside vocab": (make_params([1, vocab + 5]), "token_ids"),
        "beyond context": (with_sampling(max_tokens=context), "max_tokens"),
        "zero max_tokens": (with_sampling(max_tokens=0), "max_tokens"),
        "empty stop string": (with_sampling(stop=[""]), "stop"),
        "stop token outside vocab": (with_sampling(stop_token_ids=[vocab]), "stop_token_ids"),
    }


def test_invalid_inputs_are_rejected_while_others_stream(server: Server) -> None:
    """Every bad request is refused while another stream is in flight: that
    stream has tokens before the bad request is sent and gets more after it is
    refused. (A stream that ends meanwhile is replaced by a fresh one and the
    bad request sent again, so the test holds whatever the relative speeds.)"""
    max_tokens = 300
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        # Each RPC with its own request type, run to its end (a stream fails when read).
        rpcs = [
            ("GenerateStream",
             lambda p: list(stub.GenerateStream(pb.GenerateStreamRequest(params=p), timeout=10))),
            ("Generate", lambda p: stub.Generate(pb.GenerateRequest(params=p), timeout=10)),
        ]
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        others: list[StreamConsumer] = []

        def in_flight() -> StreamConsumer:
            """The latest long stream, a new one if it has ended; it has streamed."""
            if not others or others[-1].done:
                others.append(StreamConsumer(stub.GenerateStream(
                    pb.GenerateStreamRequest(params=ids_params([3, 4, 5], max_tokens)), timeout=120)))
                assert others[-1].wait_for_tokens(1), others[-1].error
            return others[-1]

        try:
            for name, (params, field) in _invalid_cases(info.vocab_size, info.context_length).items():
                for rpc_name, rpc in rpcs:
                    for _attempt in range(5):
                        other = in_flight()
                        with pytest.raises(grpc.RpcError) as err:
                            rpc(params)
                        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc_name, name)
                        assert field in err.value.details(), (rpc_name, name, err.value.details())
                        if other.wait_for_tokens(other.tokens + 1):
                            break         # the other stream went on after the rejection
                    else:
                        pytest.fail(f"every stream ended while {rpc_name} {name!r} was being rejected")
            results = [other.result() for other in others]
        finally:
            for other in others:
                other.call.cancel()       # no-op once it has ended
    for msgs in results:
        assert sum(len(m.token_ids) for m in msgs) == max_tokens
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_cancelled_stream_frees_its_blocks(server: Server) -> None:
    call = server.stub().GenerateStream(
        pb.GenerateStreamRequest(params=ids_params(list(range(3, 60)), 1400)), timeout=120)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 5:
            break
    assert server.stats().kv_blocks_used > 0
    call.cancel()
    stats = wait_idle(server)
    assert (stats.kv_blocks_used, stats.requests_running, stats.requests_waiting) == (0, 0, 0)
    # The server keeps serving after the cancel.
    reply = server.stub().Generate(pb.GenerateRequest(params=ids_params([3, 4], 3)), timeout=60)
    assert len(reply.token_ids) == 3


def test_unavailable_until_the_worker_is_ready(tmp_path: Path) -> None:
    """A scheduler with no worker: health NOT_SERVING, calls UNAVAILABLE."""
    model = make_tiny_llama(tmp_path / "tiny")
    args = ["--model", str(model), "--plan-addr", f"ipc://{tmp_path}/p", "--result-addr", f"ipc://{tmp_path}/r"]
    with running_server(args, tmp_path, command="scheduler", wait_serving=False) as srv:
        deadline = time.monotonic() + 60
        while health_status(srv.target) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health_status(srv.target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            srv.stub().Generate(pb.GenerateRequest(params=ids_params([1, 2], 2)), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
