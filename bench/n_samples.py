"""n > 1 on a real server: KV blocks held and prefill work, n = 4 against n = 1.

Starts `jitney serve` (a tiny random model by default, or --model) with a
step trace, sends one request with a 512-token prompt and n = 1, then the
same with n = 4 (temperature 1, ignore_eos), alone on the server, and reports
for each:

* the most KV blocks in use, from GetServerStats polled every 10 ms while
  the request runs (and, exactly, from the step trace's kv_blocks_used);
* the prompt tokens computed (the trace's prefill_tokens summed over the
  request's steps).

The issue's target: blocks(n = 4) <= 1.3 x blocks(n = 1), and the prompt
computed once (n = 4 computes 512 + 3 x (the prompt's last block) tokens).

    python bench/n_samples.py [--model DIR] [--prompt-tokens 512] [--max-tokens 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import running_server  # noqa: E402
from tests.support.tiny_models import make_tiny_llama  # noqa: E402
from jitney.client.client import Sampling, make_params  # noqa: E402
from jitney.scheduler.core.trace import read_trace  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402
from jitney.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


def run_one(target: str, prompt: list[int], n: int, max_tokens: int) -> dict[str, int]:
    """Stream one request while polling GetServerStats; the peak blocks seen."""
    peak, done = 0, threading.Event()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        def poll() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10).kv_blocks_used)
                time.sleep(0.01)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        params = make_params(prompt, sampling=Sampling(max_tokens=max_tokens, n=n, temperature=1.0, seed=11,
                                                       ignore_eos=True))
        params.cache_salt = f"n={n}"    # the second run gets no prefix-cache hit from the first
        msgs = list(stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=600))
        done.set()
        poller.join()
    usage = msgs[-1].usage
    return {"peak_blocks_polled": peak, "completion_tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: a tiny random Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or make_tiny_llama(Path(tmp) / "tiny", max_position_embeddings=2048)
        trace = Path(tmp) / "trace.jsonl"
        args = ["--model", str(model), "--trace", str(trace), "--block-size", "16", "--num-blocks", "512"]
        prompt = [5 + (i * 7) % 300 for i in range(ns.prompt_tokens)]
        results = {}
        with running_server(args, Path(tmp)) as server:
            for n in (1, 4):
                results[n] = run_one(server.target, prompt, n, ns.max_tokens)
            server_log = server.log()
        steps = read_trace(trace)    # complete once the server has exited
    # Sequence ids: the n = 1 request is seq 1, the n = 4 request seqs 2..5.
    seqs = {1: {1}, 4: {2, 3, 4, 5}}
    for n in (1, 4):
        window = [s for s in steps if seqs[n] & set(s["seats"])]
        results[n]["peak_blocks_trace"] = max(s["kv_blocks_used"] for s in window)
        results[n]["prefill_tokens"] = sum(s["prefill_tokens"] for s in window)
        results[n]["steps"] = len(window)
    ratio = results[4]["peak_blocks_trace"] / results[1]["peak_blocks_trace"]
    summary = {"prompt_tokens": ns.prompt_tokens, "max_tokens": ns.max_tokens, "n1": results[1], "n4": results[4],
               "blocks_ratio_n4_over_n1": round(ratio, 3), "target_ratio": 1.3}
    print(json.dumps(summary, indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(summary, indent=2))
    if "Traceback" in server_log:
        print(server_log, file=sys.stderr)
        return 1
    return 0 if ratio <= 1.3 else 1


if __name__ == "__main__":
    sys.exit(main())
