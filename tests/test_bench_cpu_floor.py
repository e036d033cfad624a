"""bench/cpu_floor.py (issue 15's benchmark): its FLOP count, its smoke run, and its llama-server client."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from bench.cpu_floor import peak, request_flops, workload_bytes, workload_flops
from jitney.client.bench import WorkItem
from jitney.worker.model import ModelConfig

TINY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=2, rms_norm_eps=1e-5, rope_theta=10000.0)


def test_flops_by_hand() -> None:
    # One layer's weights: qkv 4 x (2*2 + 2*1*2) = 32, o 4 x 4 = 16, gate_up 4 x 12 = 48, down 6 x 4 = 24: 120.
    # Prompt 3, 2 outputs: positions 0..3 computed (the last output is never fed back): 4 positions.
    flops = request_flops(TINY, 3, 2)
    assert flops["positions"] == 4
    assert flops["linear"] == 2 * 2 * 120 * 4                    # 2 FLOPs x 2 layers x 120 weights x 4 positions
    assert flops["head"] == 2 * 10 * 4 * 2                       # at the 2 positions that sample
    assert flops["attention"] == 4 * 2 * 2 * 2 * (1 + 2 + 3 + 4)  # 4 x layers x heads x head_dim x keys
    total = workload_flops(TINY, [WorkItem("a", 0.0, [5, 6, 7], 2), WorkItem("b", 1.0, [5], 1)])
    # "b": one position (the prompt's), which samples its one token.
    assert total["positions"] == 5 and total["requests"] == 2
    assert total["linear"] == 1920 + 2 * 2 * 120 * 1
    assert total["head"] == 160 + 80 and total["attention"] == 320 + 32
    assert total["total"] == total["linear"] + total["head"] + total["attention"] == 2400 + 480 + 80 + 32
    assert total["by_shape"] == {"qkv_proj": 2 * 32 * 2 * 5, "o_proj": 2 * 16 * 2 * 5, "gate_up_proj": 2 * 48 * 2 * 5,
                                 "down_proj": 2 * 24 * 2 * 5, "lm_head": 2 * 40 * 3}
    assert sum(total["by_shape"].values()) == total["linear"] + total["head"]


def test_bytes_by_hand() -> None:
    # Weights: the layers' 120 x 2 layers + the head's 4 x 10 = 280 values, 2 bytes each.
    # K/V per key: 2 (K and V) x 2 layers x 1 kv head x head_dim 2 x 2 bytes = 16 bytes.
    # "a": prompt 3, 3 outputs: decodes attend 4 and 5 keys. "b": prompt 5, 1 output: no decode.
    data = workload_bytes(TINY, [WorkItem("a", 0.0, [5, 6, 7], 3), WorkItem("b", 1.0, [1, 2, 3, 4, 5], 1)])
    assert data["weights_per_step"] == 2 * 280 and data["kv_per_token"] == 16
    assert data["decode_steps"] == 2                                 # the longest request's M - 1
    assert data["weights"] == 2 * 2 * 280 and data["kv"] == 16 * (4 + 5)
    assert data["total"] == data["weights"] + data["kv"]
    assert workload_bytes(TINY, [WorkItem("a", 0.0, [5], 2)], dtype_bytes=1)["kv"] == 8 * 2


def test_peak_is_the_better_kernel_over_the_workload_mix() -> None:
    shapes = [{"name": "a", "InvariantLinear": 100.0, "F.linear": 200.0},
              {"name": "b", "InvariantLinear": 50.0, "F.linear": 10.0}]
    # 300 GFLOP of a and 100 of b: 3 s + 2 s at InvariantLinear's rates, 1.5 s + 10 s at F.linear's.
    got = peak(shapes, {"a": 300, "b": 100})
    assert got["mix_gflops"] == pytest.approx({"InvariantLinear": 400 / 5, "F.linear": 400 / 11.5})
    assert (got["peak_kernel"], got["peak_gflops"]) == ("InvariantLinear", pytest.approx(80.0))


@pytest.mark.slow
def test_smoke_run_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import cpu_floor

    # One case made to fail for sure (its server refuses the flag at once): the run must report it and go on.
    monkeypatch.setitem(cpu_floor.SERVER_CASES, "int8-offline", ("offline-64.jsonl", [*cpu_floor.INT8, "--no-such"]))
    out, js = tmp_path / "report.md", tmp_path / "report.json"
    cases = ["floor", "decode-bf16", "decode-int8", "decode-int4", "bf16-offline", "int8-offline", "llama-offline"]
    code = cpu_floor.main(["--smoke", "--cases", *cases, "--workdir", str(tmp_path / "work"), "--out", str(out),
                           "--json", str(js)])
    stdout = capsys.readouterr().out
    res = json.loads(js.read_text())
    report = out.read_text()
    assert report in stdout
    # Every case asked for is either measured or reported failed with its reason, and the run went on.
    failed = [n for n, c in [*res["cases"].items(), *res["decode"].items()] if "error" in c]
    assert code == 1 and "int8-offline" in failed
    assert "unrecognized arguments: --no-such" in res["cases"]["int8-offline"]["error"]
    assert "**Failed cases**" in report and "| int8-offline |" in report
    assert set(res["cases"]) == {"bf16-offline", "int8-offline"}
    assert set(res["decode"]) == {"decode-bf16", "decode-int8", "decode-int4"}
    assert "error" not in res["floor"] and "error" not in res["cases"]["bf16-offline"]
    for mode in res["decode"].values():
        assert "error" not in mode and [r["batch"] for r in mode["rows"]] == [1, 8, 64]
    peak = res["floor"]["peak"]
    assert peak["peak_gflops"] == max(peak["mix_gflops"].values()) > 0
    assert len(peak["passes"]) == len(peak["pass_peaks"]) == 2           # the run's start and end
    assert peak["peak_gflops"] >= max(peak["pass_peaks"]) * 0.999         # each shape at its better pass
    assert res["floor"]["floor_s"] == pytest.approx(res["floor"]["flops"]["total"] / (peak["peak_gflops"] * 1e9))
    assert res["floor"]["flops"]["requests"] == res["cases"]["bf16-offline"]["requests"] == 4
    for heading in ("## The bf16 matmul floor", "## Serving", "## Decode step", "## Targets"):
        assert heading in report
    assert "× the floor" in report and "llama.cpp: " in report
    fl = res["floor"]
    assert len(fl["bandwidth_passes"]) == 2 and fl["bandwidth_gbs"] == max(fl["bandwidth_passes"]) > 0
    assert fl["bytes_floor_s"] == pytest.approx(fl["bytes"]["total"] / (fl["bandwidth_gbs"] * 1e9))
    assert fl["bytes"]["decode_steps"] == 19                         # the smoke workload's longest: 20 outputs
    assert "### The bytes floor" in report and f"{fl['bandwidth_gbs']:.1f} GB/s" in report
    # The targets: one row each, "met"/"missed" exactly where both sides were measured.
    targets = {t["target"]: t for t in res["targets"]}
    assert len(targets) == 7
    floor_row = next(t for name, t in targets.items() if "floor" in name)
    assert floor_row["value"] == pytest.approx(res["cases"]["bf16-offline"]["wall_s"] / res["floor"]["floor_s"])
    assert floor_row["met"] == (floor_row["value"] <= 1.6)
    for t in targets.values():
        assert (t["met"] is None) == (t["value"] is None)
    static = next(t for name, t in targets.items() if "static-8" in name)
    assert static["met"] is None     # static-8 was not asked for
    assert "– (not measured)" in report


FAKE_LLAMA = textwrap.dedent('''
    import argparse, asyncio, json
    from aiohttp import web

    p = argparse.ArgumentParser()
    for flag in ("-m", "--host", "-np", "-c", "-t"):
        p.add_argument(flag)
    p.add_argument("--port", type=int)
    args = p.parse_args()

    async def health(request):
        return web.json_response({"status": "ok"})

    async def completion(request):
        body = await request.json()
        assert body["ignore_eos"] and body["stream"] and body["temperature"] == 0
        resp = web.StreamResponse()
        await resp.prepare(request)
        n = body["n_predict"]
        for i in range(n - 1):   # the last token is held back, as an incomplete UTF-8 piece would be
            await resp.write(b"data: " + json.dumps({"content": "x", "stop": False}).encode() + b"\\n\\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: " + json.dumps({"content": "y", "stop": True, "tokens_predicted": n}).encode()
                         + b"\\n\\n")
        return resp

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/completion", completion)])
    web.run_app(app, host=args.host, port=args.port, print=None)
''')


def test_llama_server_client_against_a_fake(tmp_path: Path) -> None:
    from bench import llama_server

    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n{FAKE_LLAMA}")
    exe.chmod(0o755)
    items = [WorkItem("a", 0.0, [1, 2, 3], 5), WorkItem("b", 0.1, [4], 3)]
    summary = llama_server.run_case(items, tmp_path / "m.gguf", tmp_path, parallel=2, threads=1, exe=str(exe),
                                    startup_timeout=30)
    assert (summary["requests"], summary["errors"], summary["output_tokens"]) == (2, 0, 8)
    assert summary["tpot_s"]["p50"] > 0 and summary["ttft_s"]["p50"] >= 0
    assert summary["flags"] == ["llama-server", "-m", "m.gguf", "-np", "2", "-c", "2048", "-t", "1"]
