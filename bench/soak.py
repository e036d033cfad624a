"""The long soak: `python bench/soak.py [--kills 6] [--clients 32]`.

The same fault-injection mix as tests/e2e/test_soak.py (see tests/support/soak_load.py), with
more clients, more worker kills and more calls, against `jitney serve` on a
tiny random model with a small KV cache. Prints the outcome counts; exits 1
if any call broke a rule.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import running_server  # noqa: E402
from tests.support.soak_load import Soak, greedy_jobs, stream_tokens, wait_drained, wait_serving  # noqa: E402
from tests.support.tiny_models import make_tiny_llama  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6, help="worker SIGKILLs")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--calls", type=int, default=400, help="most calls per client")
    parser.add_argument("--between", type=float, default=5.0, help="seconds of load between kills")
    parser.add_argument("--num-blocks", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny", max_position_embeddings=4096)
        server_args = ["--model", str(model), "--num-blocks", str(args.num_blocks),
                       "--max-num-seqs", "16", "--max-num-batched-tokens", "128",
                       "--max-queued-requests", "24", "--worker-timeout", "3", "--dtype", "float32"]
        with running_server(server_args, Path(tmp)) as server:
            jobs = greedy_jobs(32)
            reference = {job: stream_tokens(server, job.params()) for job in jobs}
            soak = Soak(server, jobs, reference)
            start = time.monotonic()
            counts = soak.run(clients=args.clients, kills=args.kills, between=args.between,
                              tail=3.0, max_calls_per_client=args.calls)
            wait_serving(server)
            stats = wait_drained(server)
            for name, n in sorted(counts.items()):
                print(f"{n:8d}  {name}")
            print(f"{sum(counts.values()) - counts['cut short by a worker loss, tokens kept']} calls "
                  f"in {time.monotonic() - start:.1f} s, worker kills {soak.kills}, restarts "
                  f"{stats.worker_restarts}, blocks used after {stats.kv_blocks_used}")
            problems = soak.problems()
            for p in problems[:50]:
                print("PROBLEM:", p)
            return 1 if problems or stats.kv_blocks_used else 0


if __name__ == "__main__":
    sys.exit(main())
