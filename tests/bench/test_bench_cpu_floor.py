"""bench/cpu_floor.py (issue 15's benchmark): its FLOP count, its smoke run, and its llama-server client."""

from __future__ import annotations

import json
import statistics
import sys
import textwrap
from pathlib import Path

import pytest

from bench.cpu_floor_measure import peak
from bench.cpu_floor_model import request_flops, step_floors, weight_bytes, workload_bytes, workload_flops
from bench.cpu_floor_report import targets
from jitney.client.bench import WorkItem
from jitney.worker.models.config import ModelConfig

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


def test_step_floors_by_hand() -> None:
    # TINY at 1 GFLOP/s and 1 GB/s. Weights: 280 values, 560 bytes in bf16; int8: 280 bytes + 4 bytes a channel
    # of the layers' 2 x (8 + 4 + 12 + 4) = 56 and the head's 10: 280 + 264.
    assert weight_bytes(TINY, "bf16") == 560 and weight_bytes(TINY, "int8") == 280 + 4 * 66
    with pytest.raises(ValueError, match="unknown weight kind"):
        weight_bytes(TINY, "fp8")
    steps = [
        # a prompt chunk of 3 that samples: 2 x 240 x 3 + 2 x 40 x 1 + 4 x 2 x 2 x 2 x (1 + 2 + 3) = 1440 + 80 + 192
        # FLOPs, 560 + 16 x 3 bytes: FLOP-bound, 1712 ns.
        {"seats": [1], "prefill_tokens": 3, "decode_tokens": 0, "samples": 1, "context_tokens": 3,
         "attended_keys": 6, "model_s": 4e-6},
        # a decode at position 3: 480 + 80 + 32 x 4 = 688 FLOPs, 560 + 64 = 624 bytes: 688 ns.
        {"seats": [1], "prefill_tokens": 0, "decode_tokens": 1, "samples": 1, "context_tokens": 4,
         "attended_keys": 4, "model_s": 1e-6},
        # a step that only frees: no model, left out.
        {"seats": [], "prefill_tokens": 0, "decode_tokens": 0, "samples": 0, "context_tokens": 0,
         "attended_keys": 0, "model_s": 0.0},
        # 8 decodes whose sequences hold 36 keys in all: 8 x 480 + 8 x 80 + 32 x 36 = 5632 FLOPs,
        # 560 + 16 x 36 = 1136 bytes: 5632 ns.
        {"seats": list(range(8)), "prefill_tokens": 0, "decode_tokens": 8, "samples": 8, "context_tokens": 36,
         "attended_keys": 36, "model_s": 2e-5},
    ]
    got = step_floors(TINY, steps, 1.0, 1.0)
    rows = {g["group"]: g for g in got["groups"]}
    assert list(rows) == ["with prompt work", "decode, 8-31 sequences", "decode, 1-7 sequences"]
    assert rows["with prompt work"]["floor_s"] == pytest.approx(1712e-9)
    assert rows["decode, 1-7 sequences"]["floor_s"] == pytest.approx(688e-9)
    assert rows["decode, 8-31 sequences"]["floor_s"] == pytest.approx(5632e-9)
    assert (got["steps"], got["model_s"]) == (3, pytest.approx(25e-6))
    assert got["floor_s"] == pytest.approx((1712 + 688 + 5632) * 1e-9)
    # At a slow memory the decode at one sequence turns bound by its bytes: 624 ns at 1 GB/s -> 1248 at 0.5.
    slow = {g["group"]: g for g in step_floors(TINY, steps, 1.0, 0.5)["groups"]}
    assert slow["decode, 1-7 sequences"]["floor_s"] == pytest.approx(1248e-9)
    assert slow["decode, 1-7 sequences"]["flops_bound"] == 0 and slow["with prompt work"]["flops_bound"] == 1
    # In phases (linears, head, attention one after another), each phase's own floor. At 1 GB/s every phase of these
    # steps is FLOP-bound, or even: the same sums as above.
    assert [g["phases_s"] for g in got["groups"]] == pytest.approx([1712e-9, 5632e-9, 688e-9])
    assert got["phases_s"] == pytest.approx(got["floor_s"])
    # At 0.25 GB/s the 8 decodes' linears (3840 FLOPs against 480 bytes: 1920 ns) and head (640 against 80: 320 ns)
    # stay FLOP-bound while their attention turns bound by its bytes (1152 FLOPs against 16 x 36 = 576 bytes:
    # 2304 ns): 3840 + 640 + 2304 = 6784 ns in phases, where the whole step's larger sum is 5632 FLOPs
    # (its 560 + 576 = 1136 bytes take 4544 ns).
    quarter = {g["group"]: g for g in step_floors(TINY, steps, 1.0, 0.25)["groups"]}
    assert quarter["decode, 8-31 sequences"]["floor_s"] == pytest.approx(5632e-9)
    assert quarter["decode, 8-31 sequences"]["phases_s"] == pytest.approx(6784e-9)
    # A step that samples nothing reads no head: a chunk of 3 mid-prompt, 1440 + 192 FLOPs; at 0.25 GB/s its
    # 480 + 48 bytes take 2112 ns (2432 had the head's 80 been counted), its phases max(1440, 1920) + max(192, 192).
    mid = [{"seats": [1], "prefill_tokens": 3, "decode_tokens": 0, "samples": 0, "context_tokens": 3,
            "attended_keys": 6, "model_s": 4e-6}]
    got_mid = step_floors(TINY, mid, 1.0, 0.25)
    assert got_mid["floor_s"] == pytest.approx(2112e-9) and got_mid["phases_s"] == pytest.approx(2112e-9)


def test_targets_show_the_ratio_at_the_floors() -> None:
    res = {"cases": {"bf16-offline": {"output_tok_s": 300.0, "wall_s": 10.0}, "static-8": {"output_tok_s": 100.0}},
           "decode": {}, "floor": {"floor_s": 5.0},
           "step_floors": {"bf16-offline": {"floor_s": 6.0, "phases_s": 6.5}, "static-8": {"floor_s": 12.0,
                                                                                         "phases_s": 12.0}},
           "decode_bytes": {"bf16": 560, "int8": 280, "kv": 20}}
    rows = {t["target"].split(",")[0].split(" (")[0]: t for t in targets(res)}
    cont = rows["continuous"]
    assert (cont["value"], cont["met"], cont["at_floors"]) == (pytest.approx(3.0), True, pytest.approx(2.0))
    assert cont["at_phases"] == pytest.approx(12.0 / 6.5)
    off = rows["offline-64 wall"]
    assert (off["value"], off["met"], off["at_floors"]) == (pytest.approx(2.0), False, pytest.approx(1.2))
    assert off["at_phases"] == pytest.approx(1.3)
    one = next(t for t in targets(res) if t["target"].startswith("decode step batch 1, model ms: bf16 / int8"))
    assert (one["value"], one["met"], one["at_floors"], one["at_phases"]) == (None, None, pytest.approx(580 / 300),
                                                                            None)


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
    # bf16-offline's step trace against each step's floor, at the run's own peak and read rate.
    sf = res["step_floors"]["bf16-offline"]
    assert sf["peak_gflops"] == peak["peak_gflops"] and sf["rate_gbs"] == fl["bandwidth_gbs"]
    assert sf["steps"] == sum(g["steps"] for g in sf["groups"]) > 0 and 0 < sf["floor_s"] < sf["model_s"]
    assert floor_row["at_floors"] == pytest.approx(sf["floor_s"] / fl["floor_s"])
    assert sf["floor_s"] <= sf["phases_s"] * (1 + 1e-9) and sf["phases_s"] < sf["model_s"]   # the tighter bound
    assert floor_row["at_phases"] == pytest.approx(sf["phases_s"] / fl["floor_s"])
    assert static["at_floors"] is None and "### Each step against its own floor" in report
    int8_one = next(t for name, t in targets.items() if name.startswith("decode step batch 1, model ms: bf16 / int8"))
    assert 1 < int8_one["at_floors"] < 2      # the bytes ratio: int8's scales and the shared K/V keep it under 2
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


def test_step_floors_with_int8_weights() -> None:
    # int8: the layers' 240 weights + 4 bytes for each of their 2 x 28 output channels = 464 bytes, the head's
    # 40 + 4 x 10 = 80. A decode at position 3 reads 464 + 80 + 64 = 608 bytes; at 0.25 GB/s: 2432 ns (bytes-bound:
    # its 688 FLOPs take 688 ns), where bf16's 624 bytes take 2496.
    from bench.cpu_floor_model import weight_bytes_split

    assert weight_bytes_split(TINY, "int8") == (464, 80) and weight_bytes_split(TINY, "bf16") == (480, 80)
    step = [{"seats": [1], "prefill_tokens": 0, "decode_tokens": 1, "samples": 1, "context_tokens": 4,
             "attended_keys": 4, "model_s": 1e-6}]
    assert step_floors(TINY, step, 1.0, 0.25, "int8")["floor_s"] == pytest.approx(2432e-9)
    assert step_floors(TINY, step, 1.0, 0.25)["floor_s"] == pytest.approx(2496e-9)
    with pytest.raises(ValueError, match="unknown weight kind"):
        step_floors(TINY, step, 1.0, 0.25, "fp8")


def test_real_shapes_stream_floor_and_phases() -> None:
    # bench/real_shapes.py's one-stream floor and its phase report, on made-up outcomes and steps.
    from bench.real_shapes import phase_report, stream_floor_s
    from jitney.client.bench import Outcome

    # Prompt 3, 3 tokens: decodes at 4 and 5 keys read 560 + 16 x 4 and 560 + 16 x 5 bytes: 632 ns mean at 1 GB/s.
    item = WorkItem("a", 0.0, [5, 6, 7], 3)
    assert stream_floor_s(TINY, "bf16", item, 1.0) == pytest.approx(632e-9)
    assert stream_floor_s(TINY, "int8", item, 1.0) == pytest.approx(632e-9 - 16e-9)

    def done(it: WorkItem, times: list[float]) -> Outcome:
        return Outcome(it, token_times=times, num_tokens=len(times))

    a, b = WorkItem("a", 0.0, [5] * 9, 11), WorkItem("b", 0.0, [6] * 9, 11)
    ten = [0.1 * k for k in range(11)]                        # TPOT 100 ms
    phases = {"batch-1": {"outcomes": [done(a, ten)], "wall_s": 2.0, "steps": []},
              "batch-2": {"outcomes": [done(a, ten)], "wall_s": 1.0, "steps": []},
              "stream": {"outcomes": [done(a, ten), done(b, [0.2 * k for k in range(11)])], "wall_s": 3.0,
                         "steps": []},
              "after-idle": {"outcomes": [done(a, [0.15 * k for k in range(11)])], "wall_s": 1.5, "steps": []},
              "after-idle-next": {"outcomes": [done(b, ten)], "wall_s": 1.0, "steps": []}}
    got = phase_report(TINY, "bf16", {"phases": phases}, 1.0, 1.0)
    assert got["batch16"]["walls_s"] == [2.0, 1.0] and got["batch16"]["median_s"] == 1.5
    assert got["batch16"]["spread"] == pytest.approx(1 / 1.5, abs=1e-3)
    assert got["idle_tpot_ratio"] == 1.5                       # against the same request's stream TPOT, 100 ms
    stream = [s for s in got["streams"] if s["phase"] == "stream"]
    assert [s["tpot_ms"] for s in stream] == [100.0, 200.0]
    ratios = [0.1 / stream_floor_s(TINY, "bf16", a, 1.0), 0.2 / stream_floor_s(TINY, "bf16", b, 1.0)]
    assert [s["over_floor"] for s in stream] == pytest.approx(ratios, rel=1e-3)
    assert got["stream_over_floor_median"] == pytest.approx(statistics.median(ratios), rel=1e-3)
