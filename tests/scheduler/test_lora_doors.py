"""LoRA adapters through both doors (scheduler/api/lora_service.py, the OpenAI
door's lora_routes.py, the gRPC LoadLoraAdapter/UnloadLoraAdapter): load,
select by ``model`` / ``lora_adapter``, list, unload, and every bad adapter
refused with the server unchanged (other requests keep running). The
scripted worker checks the slot contract of every plan (fake_worker.py).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from jitney.v1 import generation_pb2 as pb
from tests.support.door_harness import Harness
from tests.support.lora_folders import write_adapter, lora_ready
from tests.support.scripted_worker import MODEL, PLAIN, make_tokenizer
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = Harness(tmp_path_factory.mktemp("ipc"), make_tokenizer(), max_queued=64,
                      ready=lora_ready(max_loras=2))
    try:
        harness.start_worker()
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture
def srv(server: Harness) -> Iterator[Harness]:
    yield server
    wait_for(lambda: server.engine_load() == (0, 0, 0, 0), timeout=10.0, interval=0.01)   # nothing leaks
    for name in server.servicer.lora.registry.names():
        post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def post(server: Harness, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            text = response.read().decode()
            return response.status, text
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete(server: Harness, model: str, max_tokens: int = 4) -> str:
    answer = server.client.completions.create(model=model, prompt="the quick brown fox", max_tokens=max_tokens,
                                              temperature=0)
    assert answer.model == model
    return answer.choices[0].text


def test_load_select_list_unload(srv: Harness, folders: Path) -> None:
    path = write_adapter(folders / "good")
    status, text = post(srv, "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(path)})
    assert status == 200 and "good" in text
    models = {m.id: m for m in srv.client.models.list().data}
    assert models["good"].model_extra == {"parent": MODEL, "root": str(path)}
    loads_before = len(srv.worker.lora_loads)
    assert complete(srv, "good") == PLAIN[:len(complete(srv, MODEL))]
    assert srv.worker.lora_loads[loads_before:] == [(1, "good")]   # loaded once, on first use
    chat = srv.client.chat.completions.create(model="good", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3)
    assert chat.model == "good" and len(srv.worker.lora_loads) == loads_before + 1
    status, text = post(srv, "/v1/unload_lora_adapter", {"lora_name": "good"})
    assert status == 200
    with pytest.raises(Exception) as refused:
        complete(srv, "good")
    assert getattr(refused.value, "status_code", None) == 404
    assert getattr(refused.value, "code", None) == "model_not_found" and "`good`" in str(refused.value)
    assert "good" not in {m.id for m in srv.client.models.list().data}


def test_tokenize_takes_an_adapters_name(srv: Harness, folders: Path) -> None:
    """/tokenize and /detokenize: an adapter's name is the base model's tokenizer; an
    unknown name, or one unloaded, is 404 model_not_found as on the other routes."""
    path = str(write_adapter(folders / "tok"))
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "tok", "lora_path": path})[0] == 200
    status, base = post(srv, "/tokenize", {"model": MODEL, "prompt": "the quick brown fox"})
    assert status == 200
    assert post(srv, "/tokenize", {"model": "tok", "prompt": "the quick brown fox"}) == (200, base)
    ids = json.loads(base)["tokens"]
    assert post(srv, "/detokenize", {"model": "tok", "tokens": ids})[0] == 200
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "tok"})[0] == 200
    for model in ("tok", "other"):
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": ids})):
            status, refused = post(srv, route, {"model": model, **body})
            assert status == 404 and refused["error"]["code"] == "model_not_found", refused
            assert refused["error"]["param"] == "model" and f"`{MODEL}`" in refused["error"]["message"]


BAD = [
    ("not a folder", lambda d: d / "missing", "lora_path", "not a folder"),
    ("no config", lambda d: _without(write_adapter(d / "noconf"), "adapter_config.json"), "lora_path",
     "no adapter_config.json"),
    ("rank above the max", lambda d: write_adapter(d / "big", rank=16), "lora_path", "above --max-lora-rank 8"),
    ("unknown module", lambda d: write_adapter(d / "mlp", modules=("q_proj", "gate_proj")), "lora_path",
     "'gate_proj', which this model does not offer"),
    ("wrong shapes", lambda d: write_adapter(d / "other", shapes={"q_proj": (128, 128)}), "lora_path",
     "another base model"),
    ("layer out of range", lambda d: write_adapter(d / "deep", layers=(0, 5)), "lora_path", "the model has 2 layers"),
    ("DoRA", lambda d: write_adapter(d / "dora", use_dora=True), "lora_path", "DoRA"),
]


def _without(path: Path, name: str) -> Path:
    (path / name).unlink()
    return path


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_adapters_are_refused_and_the_server_is_unchanged(srv: Harness, folders: Path, case: Any) -> None:
    _, make, param, words = case
    srv.worker.step_seconds = 0.02
    streaming: list[str] = []
    stream = threading.Thread(target=lambda: streaming.append(complete(srv, MODEL, max_tokens=12)))
    stream.start()
    try:
        status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(make(folders))})
        assert status == 400, body
        assert body["error"]["param"] == param and words in body["error"]["message"], body
        request = pb.LoadLoraAdapterRequest(lora_name="bad2", lora_path=str(make(folders / "grpc")))
        with pytest.raises(grpc.RpcError) as grpc_refused:
            srv.stub.LoadLoraAdapter(request, timeout=20)
        assert grpc_refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert words in grpc_refused.value.details()
    finally:
        stream.join(20)
        srv.worker.step_seconds = 0.0
    assert streaming and streaming[0], "a running request kept streaming"
    assert srv.servicer.lora.registry.names() == []


def test_names_duplicates_and_unknown(srv: Harness, folders: Path) -> None:
    path = str(write_adapter(folders / "named"))
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path})[0] == 200
    status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path})
    assert status == 409 and body["error"]["param"] == "lora_name"
    status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": path})
    assert status == 400 and "served model's name" in body["error"]["message"]
    status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": " a", "lora_path": path})
    assert status == 400 and body["error"]["param"] == "lora_name"
    status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": "b"})
    assert status == 400 and body["error"]["param"] == "lora_path"
    status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": path, "x": 1})
    assert status == 400 and body["error"]["param"] == "x"
    status, body = post(srv, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404 and "nope" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as unknown:
        srv.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="nope"), timeout=20)
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_grpc_selects_an_adapter_and_model_info_lists_it(srv: Harness, folders: Path) -> None:
    path = str(write_adapter(folders / "rpc", rank=2))
    loaded = srv.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="rpc", lora_path=path), timeout=20)
    assert loaded.rank == 2 and list(loaded.target_modules) == ["q_proj", "v_proj"]
    info = srv.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=20)
    assert [(a.name, a.path, a.rank) for a in info.lora_adapters] == [("rpc", path, 2)] and info.max_loras == 2
    params = pb.GenerationParams(text="hello", lora_adapter="rpc", sampling=pb.SamplingParams(max_tokens=3))
    answer = srv.stub.Generate(pb.GenerateRequest(params=params), timeout=20)
    assert answer.text
    assert srv.worker.lora_loads[-1][1] == "rpc"
    params.lora_adapter = "unknown"
    with pytest.raises(grpc.RpcError) as refused:
        srv.stub.Generate(pb.GenerateRequest(params=params), timeout=20)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "params.lora_adapter" in refused.value.details()


def test_three_adapters_over_two_slots_while_requests_run(srv: Harness, folders: Path) -> None:
    for name in ("x", "y", "z"):
        path = str(write_adapter(folders / name))
        assert post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})[0] == 200
    srv.worker.step_seconds = 0.005
    outcomes: list[tuple[str, object]] = []

    def run(model: str) -> None:
        try:
            outcomes.append((model, complete(srv, model, max_tokens=6)))
        except Exception as exc:     # the unloaded adapter's late requests: 404
            outcomes.append((model, getattr(exc, "status_code", exc)))

    threads = [threading.Thread(target=run, args=(m,)) for m in ("x", "y", "z", MODEL, "x", "z") * 2]
    for t in threads:
        t.start()
    post(srv, "/v1/unload_lora_adapter", {"lora_name": "y"})    # while its requests run or wait
    for t in threads:
        t.join(30)
    srv.worker.step_seconds = 0.0
    assert len(outcomes) == len(threads)
    for model, outcome in outcomes:
        assert (isinstance(outcome, str) and outcome) or (model == "y" and outcome == 404), (model, outcome)
    assert {name for _, name in srv.worker.lora_loads} >= {"x", "z"}
    registry = srv.servicer.metrics.registry
    assert registry.get_sample_value("jitney:lora_loads_total") == len(srv.worker.lora_loads)
    assert registry.get_sample_value("jitney:lora_adapters_resident") == len(srv.call(_resident(srv))) > 0
    resident = srv.call(_resident(srv))
    assert len(resident) <= 2 and all(holders == 0 for _, _, holders in resident)


async def _resident(srv: Harness) -> list[tuple[int, str, int]]:
    assert srv.servicer.state is not None
    return srv.servicer.state.engine.scheduler.lora.resident()
