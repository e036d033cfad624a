"""LoRA through the real ``serve`` (scheduler/main.py): ``--lora-modules`` read
at start and checked at the worker's Ready, and the load/unload routes and
RPCs behind the API key like every other route."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from jitney.common.lora_adapter import AdapterError
from jitney.scheduler.api.lora_service import LoraService, read_lora_modules
from jitney.scheduler.main import SchedulerProcessConfig, serve
from jitney.v1 import generation_pb2 as pb
from tests.support.in_process_scheduler import InProcessScheduler
from tests.support.lora_folders import lora_ready, write_adapter
from tests.support.security_keys import ALICE, TIMEOUT


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    write_adapter(folder / "first")
    write_adapter(folder / "second", rank=2)
    return folder


@pytest.fixture(scope="module")
def keyed(model: Path, key_file: Path, adapters: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[InProcessScheduler]:
    server = InProcessScheduler(tmp_path_factory.mktemp("keyed"), model, None, ready=lora_ready(),
                                api_key_file=str(key_file), lora_modules=(f"first={adapters / 'first'}",))
    yield server
    server.close()


def http(server: InProcessScheduler, path: str, body: object | None, key: str | None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_lora_routes_need_the_key(keyed: InProcessScheduler, adapters: Path) -> None:
    load = {"lora_name": "second", "lora_path": str(adapters / "second")}
    assert http(keyed, "/v1/load_lora_adapter", load, None)[0] == 401
    assert http(keyed, "/v1/load_lora_adapter", load, "not-a-key")[0] == 401
    assert http(keyed, "/v1/unload_lora_adapter", {"lora_name": "first"}, None)[0] == 401
    with pytest.raises(grpc.RpcError) as refused:
        keyed.stub().LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="x", lora_path=load["lora_path"]),
                                     timeout=TIMEOUT)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as refused:
        keyed.stub().UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="first"), timeout=TIMEOUT)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    status, models = http(keyed, "/v1/models", None, ALICE)
    assert status == 200 and [m["id"] for m in json.loads(models)["data"]][1:] == ["first"]   # --lora-modules
    assert http(keyed, "/v1/load_lora_adapter", load, ALICE)[0] == 200
    status, body = http(keyed, "/v1/completions", {"model": "second", "prompt": "hi", "max_tokens": 2}, ALICE)
    assert status == 200 and json.loads(body)["model"] == "second"
    assert http(keyed, "/v1/unload_lora_adapter", {"lora_name": "second"}, ALICE)[0] == 200
    keyed.stub(ALICE).UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="first"), timeout=TIMEOUT)
    assert json.loads(http(keyed, "/v1/models", None, ALICE)[1])["data"][1:] == []


def _refused_at_start(model: Path, tmp: Path, capsys: pytest.CaptureFixture[str], *entries: str) -> str:
    cfg = SchedulerProcessConfig(str(model), "127.0.0.1", 0, None, None, "continuous",
                                 f"ipc://{tmp}/plan", f"ipc://{tmp}/result", lora_modules=entries)
    assert asyncio.run(serve(cfg, stop=asyncio.Event(), drain=asyncio.Event())) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("entry, words", [
    ("nameonly", "expected NAME=PATH"),
    ("a=/no/such/folder", "not a folder"),
    (" a=/x", "the name must be 1-256 printable characters"),
])
def test_bad_lora_modules_stop_the_start(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         entry: str, words: str) -> None:
    err = _refused_at_start(model, tmp_path, capsys, entry)
    assert "--lora-modules" in err and words in err


def test_a_lora_modules_name_twice_or_the_models_stops_the_start(model: Path, tmp_path: Path, adapters: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = adapters / "first"
    assert "given twice" in _refused_at_start(model, tmp_path, capsys, f"a={path}", f"a={path}")
    assert "served model's" in _refused_at_start(model, tmp_path, capsys, f"{model.name}={path}")


def test_lora_modules_are_checked_against_the_worker(adapters: Path) -> None:
    engine = SimpleNamespace(scheduler=None)
    no_lora = lora_ready(max_loras=0)
    service = LoraService(read_lora_modules([f"a={adapters / 'first'}"]))
    with pytest.raises(AdapterError, match="--max-loras"):
        service.start(no_lora, engine, ("base",))     # type: ignore[arg-type]
    small = lora_ready()
    small.max_lora_rank = 2
    service = LoraService(read_lora_modules([f"a={adapters / 'first'}"]))
    with pytest.raises(AdapterError, match="--lora-modules a=.*rank 4 is above --max-lora-rank 2"):
        service.start(small, engine, ("base",))       # type: ignore[arg-type]
    service = LoraService(read_lora_modules([f"a={adapters / 'first'}", f"b={adapters / 'second'}"]))
    service.start(lora_ready(), engine, ("base",))    # type: ignore[arg-type]
    assert service.registry.names() == ["a", "b"]
    service.start(small, engine, ("base",))           # a restarted worker with a smaller bound: a is dropped
    assert service.registry.names() == ["b"]


def test_jitney_serve_passes_lora_modules_to_the_scheduler() -> None:
    import argparse

    from jitney.scheduler.launch.supervisor import child_argv
    from jitney.scheduler.main import add_scheduler_arguments

    parser = argparse.ArgumentParser()
    add_scheduler_arguments(parser, with_shared=False)
    ns = parser.parse_args(["--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"])
    again = parser.parse_args(child_argv(parser, ns))
    assert again.lora_modules == ns.lora_modules == ["a=/x", "b=/y", "c=/z"]
