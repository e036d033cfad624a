"""Tensor parallelism (worker/distributed/parallel.py, worker/distributed/sharding.py) on gloo with two
real rank processes, against the same plans run by one process.

Two ranks sum each layer's row-parallel halves with an all-reduce, so the
logits cannot be bit-identical to one process's in general: the issue asks
for greedy ids identical and float32 logits within 1e-5 (observed: ~1e-6).
Tiny random GQA models (4 heads, 2 KV heads: one KV head per rank), the
CPU's default batch-invariant kernels.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import psutil
import pytest
import torch

from tests.support.runner_driver import scenario
from tests.support.server_harness import ROOT, free_port, running_server
from tests.support.tensor_parallel_ranks import tp_config
from tests.support.tiny_models import (make_tiny_gpt_oss, make_tiny_llama, make_tiny_phi3, make_tiny_qwen2,
                                       make_tiny_qwen3_moe)
from jitney.v1 import generation_pb2 as pb
from jitney.worker.models.config import ModelConfig
from jitney.worker.runner.model_runner import ModelRunner
from jitney.worker.distributed.sharding import check_shardable, local_config

LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("tp")
    return [str(make_tiny_llama(root / "llama")), str(make_tiny_qwen2(root / "qwen2")),
            str(make_tiny_phi3(root / "phi3")), str(make_tiny_qwen3_moe(root / "qwen3-moe")),
            str(make_tiny_gpt_oss(root / "gpt-oss"))]


@pytest.fixture(scope="module")
def two_ranks(models: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("tp-out") / "rank0.json"
    port = free_port()
    code = ("import sys; from tests.support.tensor_parallel_ranks import rank_main; "
            "rank_main(int(sys.argv[1]), {}, {!r}, {!r})")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code.format(port, models, str(out)), str(rank)], cwd=ROOT,
                              env=env) for rank in (0, 1)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


@pytest.mark.parametrize("which", [0, 1, 2, 3, 4], ids=["llama-gqa", "qwen2-qkv-bias-tied",
                                                        "phi3-fused-qkv-gate-up", "qwen3-moe-experts-split",
                                                        "gpt-oss-sinks-and-expert-biases-split"])
def test_two_ranks_match_one(models: list[str], two_ranks: list[dict[str, Any]], which: int) -> None:
    torch.set_num_threads(1)
    alone = json.loads(json.dumps(scenario(ModelRunner(tp_config(models[which])))))   # str keys, as the ranks'
    split = two_ranks[which]
    assert alone["refused"] and split["refused"]
    assert split["tokens"] == alone["tokens"]
    assert len(split["logits"]) == len(alone["logits"]) > 30
    torch.testing.assert_close(torch.tensor(split["logits"]), torch.tensor(alone["logits"]),
                               atol=LOGITS_ATOL, rtol=0)


def test_init_group_takes_one_gpu_per_rank_under_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NCCL branch of init_group, on a CPU machine with torch's calls stood in:
    rank r takes GPU r % count, then joins the group, with a gloo relay beside it."""
    import torch.distributed as dist

    from jitney.worker.distributed import parallel

    calls: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("device", index))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.setdefault("init", (backend, kw)))
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.setdefault("relay", kw["backend"]))
    config: Any = SimpleNamespace(tp_size=4, tp_rank=3, device="cuda", dist_timeout=5, dist_init="tcp://h:1")
    group = parallel.init_group(config)
    assert group is not None and (group.rank, group.size, group.relay) == (3, 4, "gloo")
    assert calls["device"] == 1
    backend, kw = calls["init"]
    assert backend == "nccl" and (kw["rank"], kw["world_size"], kw["init_method"]) == (3, 4, "tcp://h:1")


def test_local_config_splits_heads_and_the_mlp() -> None:
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4)
    assert (local_config(cfg, 2).num_heads, local_config(cfg, 2).num_kv_heads,
            local_config(cfg, 2).intermediate_size) == (2, 1, 12)
    with pytest.raises(ValueError, match=r"KV heads \(2\).*divisible by 4"):
        check_shardable(cfg, 4)


def _rank_pid(server_pid: int, rank: int) -> int:
    for child in psutil.Process(server_pid).children(recursive=True):
        cmd = child.cmdline()
        if "--tp-rank" in cmd and cmd[cmd.index("--tp-rank") + 1] == str(rank):
            return int(child.pid)
    raise LookupError(f"no rank {rank} under {server_pid}")


def test_serve_restarts_the_group_when_a_rank_dies(models: list[str], tmp_path: Path) -> None:
    args = ["--model", models[0], "--tensor-parallel-size", "2", "--dtype", "float32", "--num-blocks", "64",
            "--block-size", "16", "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--threads", "1"]
    prompt = pb.GenerationParams(token_ids=pb.TokenIds(ids=[5, 17, 42, 99]),
                                 sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True))
    with running_server(args, tmp_path) as server:
        stub = server.stub()
        before = list(stub.Generate(pb.GenerateRequest(params=prompt), timeout=60).token_ids)
        assert len(before) == 8
        first = server.stats()
        # A request in flight when rank 1 dies ends UNAVAILABLE.
        long = pb.GenerationParams(token_ids=pb.TokenIds(ids=[5, 17]),
                                   sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True))
        call = stub.GenerateStream(pb.GenerateStreamRequest(params=long), timeout=60)
        next(call)
        os.kill(_rank_pid(server.proc.pid, 1), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failed:
            for _ in call:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 90
        while True:
            try:
                stats = server.stats()
                if stats.worker_restarts >= 1 and stats.worker_pid not in (0, first.worker_pid):
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.3)
        after = list(stub.Generate(pb.GenerateRequest(params=prompt), timeout=60).token_ids)
        assert after == before                          # the new group serves the same greedy tokens
        assert "stopped the group" in server.log() and "tensor-parallel over 2 ranks" in server.log()


def test_compose_tp2_profile_is_one_scheduler_and_two_ranks() -> None:
    import yaml

    from jitney.cli import build_parser

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    tp2 = {name for name, svc in services.items() if "tp2" in svc.get("profiles", [])}
    assert tp2 == {"scheduler-tp2", "tp-rank-0", "tp-rank-1"}
    parse = build_parser().parse_args
    sched = parse(services["scheduler-tp2"]["command"][1:])
    commands = [list(services[f"tp-rank-{r}"]["command"][1:]) for r in (0, 1)]
    models = []
    for c in commands:   # the model is a path inside the containers: not parsed here
        at = c.index("--model")
        models.append(c[at + 1])
        del c[at:at + 2]
    assert models[0] == models[1]
    ranks = [parse(c) for c in commands]
    assert [(ns.command, ns.tp_rank, ns.tp_size) for ns in ranks] == [("worker", 0, 2), ("worker", 1, 2)]
    assert ranks[0].dist_init == ranks[1].dist_init == "tcp://tp-rank-0:29500"
    assert ranks[0].plan_addr == "tcp://scheduler-tp2:" + sched.plan_addr.rsplit(":", 1)[1]
    assert ranks[0].curve_keys and sched.curve_keys and ranks[1].plan_addr is None


def test_serve_refuses_a_model_whose_heads_do_not_split(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "m", num_heads=4, num_kv_heads=2)
    done = subprocess.run([sys.executable, "-m", "jitney.cli", "serve", "--model", str(model),
                           "--tensor-parallel-size", "4", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert "KV heads (2) to be divisible by 4" in done.stderr


def test_serve_refuses_the_default_gguf_model_that_does_not_split() -> None:
    """A GGUF model is checked from its metadata before any process starts: the bundled
    SmolLM2 (9 heads, 3 KV heads) does not split two ways."""
    done = subprocess.run([sys.executable, "-m", "jitney.cli", "serve", "--tensor-parallel-size", "2",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert "attention heads (9), KV heads (3) to be divisible by 2" in done.stderr
