#!/usr/bin/env python3
"""Tool calling: what the tool grammar costs.

    .venv/bin/python bench/tool_calls.py [compile] [throughput] [--requests 32]
        [--max-tokens 64] [--rounds R] [--door grpc|openai] [--target HOST:PORT]
        [--model PATH] [--json PATH] [-- SERVER FLAGS]

compile
    In this process, with the model's tokenizer (``--model``; default the bundled
    SmolLM2): a 10-tool set's grammar (scheduler/api/tools/grammar.py, generic
    format, tool_choice auto and required) compiled by ``GrammarCompiler.compile_lark``
    cold (a fresh compiler's first compile of it: grammar, matcher and first mask)
    and cached (the same tool set again), median of 5 each; plus the cold compile
    of 10 different tool sets in a row.
throughput
    Against the default model (``jitney serve`` started here unless ``--target``):
    ``--requests`` tool-calling requests (tool_choice required, a 3-tool set, all
    sent at once) and then as many plain requests of the same lengths: the same
    prompt (the generic format's tool instructions as the system turn, so the
    prompt tokens are the same; each batch in its own prefix-cache namespace, so
    neither reads the other's prompts from the cache), no tools, ``ignore_eos`` and max_tokens = the
    completion tokens its tool twin produced. Output tokens / wall time for each
    batch; the ratio is the mask and parse overhead (the issue's bar: <= 5% lost).
    ``--rounds R`` runs R pairs, alternating which kind goes first (a fresh
    cache namespace each), and reports each round's ratio and their median.
    The scheduler's mask time per masked step (GetServerStats) is reported with
    it. Timings are noisy on a shared machine; the load average is printed.
    ``--door``: the requests go through gRPC (default) or the OpenAI door's
    /v1/chat/completions (``--target`` is then the server's gRPC HOST:PORT and
    ``--openai-target`` its HTTP one). Grammar jump-forward (forced tokens fed as
    input, not sampled: engine.py) applies to OpenAI requests without logprobs, not
    to gRPC's, whose answers always carry logprobs; ``-- --no-jump-forward`` turns
    it off on the server started here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jitney.scheduler.api.tools.formats import GENERIC  # noqa: E402
from jitney.scheduler.api.tools.formats import system_text  # noqa: E402
from jitney.scheduler.api.tools.grammar import tool_grammar  # noqa: E402
from jitney.scheduler.api.tools.spec import ToolRequest, ToolSpec  # noqa: E402

CITY = {"type": "string", "maxLength": 24}
THREE_TOOLS = (
    ToolSpec("get_weather", "Current weather in a city", {
        "type": "object", "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}),
    ToolSpec("get_time", "Local time in a city", {"type": "object", "properties": {"city": CITY},
                                                 "required": ["city"]}),
    ToolSpec("search", "Search the web", {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 40}, "max_results": {"type": "integer", "minimum": 1,
                                                                       "maximum": 10}},
        "required": ["query"]}),
)
RUN = os.urandom(4).hex()
QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Find news about Mars rovers.",
             "Is it raining in Oslo?"]


def ten_tools(salt: str = "") -> tuple[ToolSpec, ...]:
    return tuple(ToolSpec(f"tool_{salt}{i}", f"tool number {i}", {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 32}, "count": {"type": "integer", "minimum": 0},
            "ratio": {"type": "number"}, "flag": {"type": "boolean"},
            "mode": {"enum": ["fast", "slow", "auto"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                      "required": ["lat", "lon"]}},
        "required": ["name", "mode"]}) for i in range(10))


def bench_compile(model: str | None) -> dict[str, Any]:
    from jitney.common.model_files import load_tokenizer, resolve_model
    from jitney.scheduler.core.grammar import GrammarCompiler

    tokenizer = load_tokenizer(resolve_model(model))
    vocab, eos = len(tokenizer), [int(tokenizer.eos_token_id)]
    t0 = time.perf_counter()
    base = GrammarCompiler(tokenizer, vocab, eos_token_ids=eos)
    index_s = time.perf_counter() - t0
    out: dict[str, Any] = {"tokenizer_index_s": round(index_s, 3), "vocab": vocab}
    for choice in ("required", "auto"):
        text = tool_grammar(GENERIC, ToolRequest(ten_tools(), choice, "", True))
        cold, cached = [], []
        for _ in range(5):
            fresh = GrammarCompiler(base.engine_tokenizer, vocab, eos_token_ids=eos)
            t = time.perf_counter()
            asyncio.run(fresh.compile_lark(text, "params.tools"))
            cold.append(time.perf_counter() - t)

            async def again() -> float:
                await fresh.compile_lark(text, "params.tools")
                t1 = time.perf_counter()
                await fresh.compile_lark(text, "params.tools")
                return time.perf_counter() - t1
            cached.append(asyncio.run(again()))
            fresh.close()
        out[choice] = {"grammar_chars": len(text), "cold_ms_median": round(statistics.median(cold) * 1e3, 2),
                       "cached_ms_median": round(statistics.median(cached) * 1e3, 4)}
    distinct = []
    for k in range(10):
        text = tool_grammar(GENERIC, ToolRequest(ten_tools(f"s{k}_"), "required", "", True))
        t = time.perf_counter()
        asyncio.run(base.compile_lark(text, "params.tools"))
        distinct.append(time.perf_counter() - t)
    out["ten_distinct_sets_cold_ms"] = [round(x * 1e3, 2) for x in distinct]
    base.close()
    return out


@contextmanager
def _server(target: str | None, openai_target: str | None, flags: list[str]) -> Iterator[tuple[str, str | None]]:
    """(gRPC target, OpenAI door's HOST:PORT): the given ones, else a server started here."""
    if target:
        yield target, openai_target
        return
    from tests.support.server_harness import free_port, running_server
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="jitney-tools-") as logs:
        with running_server(["--openai-port", str(port), *flags], Path(logs)) as srv:
            yield srv.target, f"127.0.0.1:{port}"


def _params(question: str, max_tokens: int, tools: bool, round_: int = 0) -> Any:
    from jitney.v1 import generation_pb2 as pb
    system = system_text(THREE_TOOLS, GENERIC)
    user = pb.ChatMessage(role="user", content=question)
    if tools:
        chat = pb.ChatPrompt(messages=[user])
        params = pb.GenerationParams(chat=chat, tool_choice="required", parallel_tool_calls=False,
                                     tools=[pb.Tool(name=t.name, description=t.description,
                                                    parameters=json.dumps(t.parameters)) for t in THREE_TOOLS])
    else:       # the same prompt: the generic format puts exactly this system turn first
        chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="system", content=system), user])
        params = pb.GenerationParams(chat=chat)
    # Each batch its own prefix-cache namespace: the second must not read the first's prompts.
    params.cache_salt = f"{'tools' if tools else 'plain'}-{RUN}-{round_}"
    params.sampling.max_tokens = max_tokens
    params.sampling.temperature = 0.0
    params.sampling.ignore_eos = not tools
    return params


class _Reply:
    """What a batch reads of a reply, from either door."""

    def __init__(self, completion_tokens: int, prompt_tokens: int, arguments: list[str]) -> None:
        self.completion_tokens, self.prompt_tokens, self.arguments = completion_tokens, prompt_tokens, arguments


def _openai_body(p: Any, model: str) -> dict[str, Any]:
    """``_params``' request as an OpenAI chat completions body."""
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": m.role, "content": m.content} for m in p.chat.messages],
        "max_tokens": p.sampling.max_tokens, "temperature": 0.0, "ignore_eos": p.sampling.ignore_eos,
        "cache_salt": p.cache_salt}
    if p.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": json.loads(t.parameters)}} for t in p.tools]
        body["tool_choice"], body["parallel_tool_calls"] = p.tool_choice, p.parallel_tool_calls
    return body


def _batch(stub: Any, params: list[Any], openai_target: str | None = None) -> tuple[float, list[_Reply]]:
    """All of ``params`` at once (one thread each): seconds, and the replies."""
    from jitney.v1 import generation_pb2 as pb
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name if openai_target else ""

    def grpc_call(p: Any) -> _Reply:
        r = stub.Generate(pb.GenerateRequest(params=p), timeout=600)
        return _Reply(r.usage.completion_tokens, r.usage.prompt_tokens, [c.arguments for c in r.tool_calls])

    def openai_call(p: Any) -> _Reply:
        import urllib.request
        post = urllib.request.Request(f"http://{openai_target}/v1/chat/completions",
                                      data=json.dumps(_openai_body(p, model)).encode(),
                                      headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=600) as r:
            reply = json.loads(r.read())
        calls = reply["choices"][0]["message"].get("tool_calls") or []
        return _Reply(reply["usage"]["completion_tokens"], reply["usage"]["prompt_tokens"],
                      [c["function"]["arguments"] for c in calls])

    call = openai_call if openai_target else grpc_call
    with ThreadPoolExecutor(len(params)) as pool:
        t = time.perf_counter()
        replies = list(pool.map(call, params))
        return time.perf_counter() - t, replies


def bench_throughput(target: str | None, n: int, max_tokens: int, rounds: int = 1, *, door: str = "grpc",
                     openai_target: str | None = None, flags: list[str] | None = None) -> dict[str, Any]:
    """``rounds`` pairs of batches in the order tool, plain, plain, tool, ... so a
    drift in the machine's load weighs on both kinds alike; each round's ratio
    and their median."""
    import grpc
    from jitney.v1 import generation_pb2 as pb
    from jitney.v1 import generation_pb2_grpc as pb_grpc

    with _server(target, openai_target, flags or []) as (where, http), grpc.insecure_channel(where) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        if door == "openai" and http is None:
            raise SystemExit("--door openai with --target needs --openai-target")
        via = http if door == "openai" else None
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
        # Warm-up, a tool request included: the server builds its grammar compiler (the
        # tokenizer's index, ~0.5 s) and compiles the tool set at the first one.
        _batch(stub, [_params(q, 8, False) for q in questions[:4]] + [_params(questions[0], 48, True)], via)
        # The plain twins' lengths: those the tool requests produce (greedy, so every round alike).
        _, first = _batch(stub, [_params(q, max_tokens, True, -1) for q in questions], via)
        lengths = [max(1, r.completion_tokens) for r in first]

        def tool_batch(r: int) -> dict[str, Any]:
            before = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            seconds, replies = _batch(stub, [_params(q, max_tokens, True, r) for q in questions], via)
            after = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            masked = after.grammar_masked_steps - before.grammar_masked_steps
            tokens = sum(x.completion_tokens for x in replies)
            valid = sum(1 for x in replies for a in x.arguments if isinstance(json.loads(a), dict))
            return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                    "calls_parsed": valid, "steps": after.steps - before.steps, "masked_steps": masked,
                    "forced_tokens": after.grammar_forced_tokens - before.grammar_forced_tokens,
                    "mask_ms_per_masked_step": round((after.grammar_mask_seconds - before.grammar_mask_seconds)
                                                     / max(masked, 1) * 1e3, 2),
                    "prompt_tokens": sum(x.prompt_tokens for x in replies),
                    "arguments": [a for x in replies for a in x.arguments]}

        def plain_batch(r: int) -> dict[str, Any]:
            before = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            seconds, replies = _batch(stub, [_params(q, k, False, r) for q, k in zip(questions, lengths)], via)
            after = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            tokens = sum(x.completion_tokens for x in replies)
            return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                    "steps": after.steps - before.steps,
                    "prompt_tokens": sum(x.prompt_tokens for x in replies)}

        per_round = []
        for r in range(rounds):
            if r % 2 == 0:
                tool, plain = tool_batch(r), plain_batch(r)
            else:
                plain, tool = plain_batch(r), tool_batch(r)
            per_round.append({"tool": tool, "plain": plain,
                              "ratio": round(tool["tokens_per_s"] / plain["tokens_per_s"], 3)})
        ratios = [p["ratio"] for p in per_round]
        for p in per_round:    # every round's calls are the same (greedy): shown once
            p["tool"].pop("arguments")
        return {"requests": n, "door": door, "flags": flags or [], "rounds": per_round,
                "arguments": first_arguments(first),
                "throughput_ratio_tool_over_plain": round(statistics.median(ratios), 3),
                "ratio_min_max": (min(ratios), max(ratios))}


def first_arguments(replies: list[_Reply]) -> list[str]:
    """The calls' arguments of a batch, to compare runs (jump-forward on and off give the same)."""
    return [a for r in replies for a in r.arguments]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("parts", nargs="*", help="compile and/or throughput (default: both)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="pairs of batches, alternating which goes first")
    ap.add_argument("--door", choices=("grpc", "openai"), default="grpc", help="the door the requests go through")
    ap.add_argument("--target", default=None, help="HOST:PORT of a running server with the default model")
    ap.add_argument("--openai-target", default=None, help="with --target and --door openai: its OpenAI door")
    ap.add_argument("--model", default=None, help="tokenizer for the compile part (default: the bundled SmolLM2)")
    ap.add_argument("--json", default=None, help="also write the results here")
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.parts = args.parts or ["compile", "throughput"]
    if not set(args.parts) <= {"compile", "throughput"}:
        ap.error(f"parts are compile and throughput, got {args.parts}")
    results: dict[str, Any] = {"loadavg_before": os.getloadavg(), "cpus": os.cpu_count()}
    if "compile" in args.parts:
        results["compile"] = bench_compile(args.model)
        print(json.dumps({"compile": results["compile"]}, indent=1), flush=True)
    if "throughput" in args.parts:
        results["throughput"] = bench_throughput(args.target, args.requests, args.max_tokens, args.rounds,
                                                 door=args.door, openai_target=args.openai_target, flags=flags)
        print(json.dumps({"throughput": results["throughput"]}, indent=1), flush=True)
    results["loadavg_after"] = os.getloadavg()
    print(f"load average before {results['loadavg_before']}, after {results['loadavg_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
