"""Speculative decoding on the default model: `--speculative off` against `ngram`
(and against `draft`, a draft model run by the worker).

Each case runs on a fresh `jitney serve` per method (same flags otherwise,
a step trace on), replaying a workload with `jitney bench`'s client (greedy,
ignore_eos, exactly max_tokens tokens each):

    case          workload              concurrency   target (issue 40)
    edit-alone    spec-edit-32.jsonl    1             TPOT(ngram) <= TPOT(off) / 2
    edit-all      spec-edit-32.jsonl    all at once   wall(ngram) <= wall(off)
    offline       offline-64.jsonl      all at once   wall(ngram) <= 1.03 x wall(off)
    draft-alone   spec-edit-32.jsonl    1             overhead of a useless draft (draft vs off)
    draft-all     spec-edit-32.jsonl    all at once   the same at load

The draft cases run `--speculative draft --draft-model DIR` with a 2-layer
draft of the default model's shape (random weights, built in a temporary
folder: the model's config with 2 layers, its tokenizer): its drafts are
almost never accepted, so the case shows what the draft costs and the
adaptive rule switching it off (the drafts per step fall to 0 once its
acceptance and its measured time per token are known).

Reported per case and method: wall, TPOT, output tokens/s; with ngram the
drafts, draft tokens and accepted tokens (GetServerStats), the acceptance
rate, and the rule's behaviour per load from the trace: for each number of
running requests, the steps, the draft tokens per step and the accepted
tokens per step. Outputs are compared too: the token ids of every request
must be equal between the methods (greedy: exactness).

    python bench/spec_decode.py [--cases edit-alone edit-all offline draft-alone draft-all] [--limit N]
                                [--num-speculative-tokens K] [--repeat R] [--json PATH]

``--repeat R`` runs each case's methods in turns R times (off ngram off
ngram ...: the machine's drift falls on both); the wall and TPOT reported
per method are the medians, every run's kept beside them, and the token ids
must be equal in every run.

``--limit N`` replays only the first N requests of each workload (a short
run); ``--model`` another model than the default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.client.bench import WorkItem, load_workload, summarize  # noqa: E402
from jitney.client.channel import open_aio_channel  # noqa: E402
from jitney.scheduler.core.trace import read_trace  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402
from jitney.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.server_harness import running_server  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"
CASES = {  # case -> (workload file, max concurrency (None = all at once), the methods compared)
    "edit-alone": ("spec-edit-32.jsonl", 1, ("off", "ngram")),
    "edit-all": ("spec-edit-32.jsonl", None, ("off", "ngram")),
    "offline": ("offline-64.jsonl", None, ("off", "ngram")),
    "draft-alone": ("spec-edit-32.jsonl", 1, ("off", "draft")),
    "draft-all": ("spec-edit-32.jsonl", None, ("off", "draft")),
}


def build_random_draft(model: str | None, folder: Path, num_layers: int = 2) -> Path:
    """A ``num_layers`` draft of ``model``'s shape with random weights and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
    from jitney.worker.loading.loader import load_hf_config

    files = resolve_model(model)
    config = load_hf_config(files)
    config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder), safe_serialization=True)
    load_tokenizer(files, cache_root()).save_pretrained(str(folder))
    return folder


async def _replay(target: str, items: list[WorkItem], concurrency: int | None) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Replay ``items``; the summary, and each request's token ids."""
    limit = asyncio.Semaphore(concurrency or len(items))
    tokens: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    async with open_aio_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        t0 = time.perf_counter()

        async def one(item: WorkItem) -> None:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
            async with limit:
                params = pb.GenerationParams(token_ids=pb.TokenIds(ids=item.prompt_token_ids),
                                             sampling=pb.SamplingParams(max_tokens=item.max_tokens,
                                                                        temperature=0.0, ignore_eos=True))
                ids, stamps = tokens.setdefault(item.id, []), times.setdefault(item.id, [])
                async for msg in stub.GenerateStream(pb.GenerateStreamRequest(params=params)):
                    stamps.extend([time.perf_counter() - t0] * len(msg.token_ids))
                    ids.extend(msg.token_ids)

        await asyncio.gather(*(one(i) for i in items))
        wall = time.perf_counter() - t0
    from jitney.client.bench import Outcome

    outcomes = [Outcome(i, times[i.id], len(tokens[i.id])) for i in items]
    return summarize(outcomes, wall), tokens


def _stats(target: str) -> dict[str, int]:
    with grpc.insecure_channel(target) as channel:
        s = pb_grpc.GenerationServiceStub(channel).GetServerStats(pb.GetServerStatsRequest(), timeout=30)
    return {"drafts": s.spec_decode_num_drafts, "draft_tokens": s.spec_decode_num_draft_tokens,
            "accepted_tokens": s.spec_decode_num_accepted_tokens, "steps": s.steps}


def _per_load(trace: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """The rule's behaviour per load: steps by requests running, drafts and accepted per step."""
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for step in trace:
        groups[len(step["seats"])].append(step)
    return {n: {"steps": len(steps),
                "draft_tokens_per_step": round(sum(s.get("draft_tokens", 0) for s in steps) / len(steps), 3),
                "accepted_per_step": round(sum(s.get("accepted_tokens", 0) for s in steps) / len(steps), 3),
                "model_ms_per_step": round(1000 * sum(s["model_s"] for s in steps) / len(steps), 2)}
            for n, steps in sorted(groups.items())}


def run_case(case: str, method: str, model: str | None, limit: int | None, tmp: Path,
             k: int | None = None) -> dict[str, Any]:
    workload, concurrency, _ = CASES[case]
    items = load_workload(WORKLOADS / workload)[:limit]
    trace = tmp / f"{case}-{method}.jsonl"
    args = ["--speculative", method, "--trace", str(trace)] + (["--model", model] if model else [])
    if method == "draft":
        draft = tmp / "draft-2-layers"
        if not draft.is_dir():
            build_random_draft(model, draft)
        args += ["--draft-model", str(draft)]
    if k is not None and method != "off":
        args += ["--num-speculative-tokens", str(k)]
    with running_server(args, tmp) as server:
        summary, tokens = asyncio.run(_replay(server.target, items, concurrency))
        stats = _stats(server.target)
        log = server.log()
    if "Traceback" in log:
        raise RuntimeError(f"{case} {method}: the server logged a traceback:\n{log[-4000:]}")
    out = {"wall_s": round(summary["wall_s"], 3), "tpot_ms": round(1000 * summary["tpot_s"]["mean"], 2),
           "tpot_p50_ms": round(1000 * summary["tpot_s"]["p50"], 2),
           "output_tok_s": round(summary["output_tok_s"], 2), "errors": summary["errors"], **stats}
    if stats["draft_tokens"]:
        out["acceptance_rate"] = round(stats["accepted_tokens"] / stats["draft_tokens"], 3)
    steps = read_trace(trace)
    out["per_load"] = _per_load(steps)
    drafted = [s["step"] for s in steps if s.get("draft_tokens")]
    out["drafted_steps"] = len(drafted)          # the rule switching drafts off: none after the last
    out["last_drafted_step"] = max(drafted, default=0)
    out["_tokens"] = tokens
    return out


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's report with its wall and TPOT the runs' medians (each run's kept)."""
    import statistics
    out = dict(runs[0])
    if len(runs) > 1:
        for key in ("wall_s", "tpot_ms", "tpot_p50_ms", "output_tok_s"):
            out[f"{key}_runs"] = [r[key] for r in runs]
            out[key] = round(statistics.median(r[key] for r in runs), 3)
        out["errors"] = sum(r["errors"] for r in runs)
    return out


def targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, where both methods of a case ran."""
    verdict: dict[str, Any] = {}
    if "edit-alone" in results:
        off, on = results["edit-alone"]["off"], results["edit-alone"]["ngram"]
        verdict["edit_alone_tpot_ratio_off_over_ngram"] = round(off["tpot_ms"] / on["tpot_ms"], 3)
        verdict["edit_alone_tpot_2x"] = off["tpot_ms"] >= 2 * on["tpot_ms"]
    if "edit-all" in results:
        off, on = results["edit-all"]["off"], results["edit-all"]["ngram"]
        verdict["edit_all_wall_ratio_ngram_over_off"] = round(on["wall_s"] / off["wall_s"], 3)
        verdict["edit_all_wall_not_slower"] = on["wall_s"] <= off["wall_s"]
    if "offline" in results:
        off, on = results["offline"]["off"], results["offline"]["ngram"]
        verdict["offline_wall_ratio_ngram_over_off"] = round(on["wall_s"] / off["wall_s"], 3)
        verdict["offline_within_3pct"] = on["wall_s"] <= 1.03 * off["wall_s"]
    for case in ("draft-alone", "draft-all"):
        if case in results:
            off, on = results[case]["off"], results[case]["draft"]
            key = case.replace("-", "_")
            verdict[f"{key}_wall_ratio_draft_over_off"] = round(on["wall_s"] / off["wall_s"], 3)
            verdict[f"{key}_drafted_steps_of_all"] = f"{on['drafted_steps']} of {on['steps']}"
            verdict[f"{key}_last_drafted_step"] = on["last_drafted_step"]
    return verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled default model)")
    ap.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                    help="K for the ngram and draft runs (default: the server's)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each method, in turns")
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for case in ns.cases:
            methods = CASES[case][2]
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for _ in range(ns.repeat):
                for m in methods:
                    runs[m].append(run_case(case, m, ns.model, ns.limit, Path(tmp), ns.num_speculative_tokens))
            tokens = [r.pop("_tokens") for m in methods for r in runs[m]]
            results[case] = {m: _median_of(runs[m]) for m in methods}
            results[case]["same_tokens"] = all(t == tokens[0] for t in tokens)
            same &= results[case]["same_tokens"]
    report = {"cases": results, "targets": targets(results)}
    print(json.dumps(report, indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(report, indent=2))
    return 0 if same and not any(results[c][m]["errors"] for c in results for m in CASES[c][2]) else 1


if __name__ == "__main__":
    sys.exit(main())
