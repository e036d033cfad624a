"""llama.cpp's `llama-server` as a side-by-side baseline (optional: only where the binary is on the PATH).

Replays a workload of bench/workloads/ over llama-server's native ``/completion``
endpoint, streamed, with the same rules as `jitney bench`: prompt token ids as
they are, greedy, ``ignore_eos``, exactly ``max_tokens`` tokens, each request
sent at its ``arrival_s``. The summary has `jitney bench`'s keys
(``jitney.client.bench.summarize``), so the two render in one table.
Nothing in Jitney depends on llama.cpp; callers check ``binary()`` first.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.support.server_harness import _stop, free_port
from jitney.client.bench import Outcome, WorkItem, summarize

BINARY = "llama-server"


def binary() -> str | None:
    """The llama-server on the PATH, or None."""
    return shutil.which(BINARY)


def tuning_args(parallel: int, context_per_slot: int, threads: int | None) -> list[str]:
    """``parallel`` slots of ``context_per_slot`` tokens each (continuous batching is llama-server's default)."""
    args = ["-np", str(parallel), "-c", str(parallel * context_per_slot)]
    return args + (["-t", str(threads)] if threads else [])


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.3)
    raise TimeoutError(f"llama-server not ready after {timeout} s")


async def _run_one(session: Any, url: str, item: WorkItem, t0: float) -> Outcome:
    outcome = Outcome(item)
    await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
    body = {"prompt": item.prompt_token_ids, "n_predict": item.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "top_k": 1, "stream": True, "cache_prompt": False}
    reported: int | None = None
    try:
        async with session.post(f"{url}/completion", json=body) as resp:
            if resp.status != 200:
                outcome.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return outcome
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter() - t0
                if chunk.get("stop"):
                    reported = chunk.get("tokens_predicted", (chunk.get("timings") or {}).get("predicted_n"))
                    if reported is not None and reported > outcome.num_tokens:
                        # Tokens the stream held back (an incomplete UTF-8 piece) arrive with the end.
                        outcome.token_times.extend([now] * (reported - outcome.num_tokens))
                        outcome.num_tokens = reported
                    break
                n = len(chunk.get("tokens") or []) or 1
                outcome.token_times.extend([now] * n)
                outcome.num_tokens += n
    except Exception as err:  # noqa: BLE001 - any transport failure is this request's error
        outcome.error = f"{type(err).__name__}: {err}"
    if outcome.error is None and outcome.num_tokens != item.max_tokens:
        outcome.error = f"received {outcome.num_tokens} tokens, expected {item.max_tokens}"
    return outcome


async def replay(url: str, items: list[WorkItem]) -> tuple[list[Outcome], float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*[_run_one(session, url, i, t0) for i in items])
        wall = time.perf_counter() - t0
    return list(outcomes), wall


def run_case(items: list[WorkItem], model: Path, workdir: Path, *, parallel: int = 16,
             context_per_slot: int = 1024, threads: int | None = None, startup_timeout: float = 300,
             exe: str | None = None) -> dict[str, Any]:
    """Start llama-server on ``model``, replay ``items``, stop it; `jitney bench`'s summary plus ``flags``."""
    exe = exe or binary()
    if exe is None:
        raise FileNotFoundError(f"{BINARY} is not on the PATH")
    port = free_port()
    tuning = tuning_args(parallel, context_per_slot, threads)
    args = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port), *tuning]
    log_path = workdir / f"llama-server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, proc, startup_timeout))
        outcomes, wall = asyncio.run(replay(url, items))
    except Exception as err:
        raise RuntimeError(f"{err}\n{log_path.read_text(errors='replace')[-2000:]}") from err
    finally:
        _stop(proc)
    summary = summarize(outcomes, wall)
    summary["flags"] = [BINARY, "-m", model.name, *tuning]
    summary["failed_requests"] = [f"{o.item.id}: {o.error}" for o in outcomes if not o.ok][:5]
    return summary
