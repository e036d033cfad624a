#!/usr/bin/env python3
"""A 20-turn agent loop over the Responses API: does TTFT stay flat as the conversation grows?

    .venv/bin/python bench/agent_loop.py [--target http://HOST:PORT/v1] [--turns 20]
        [--mode auto|tools|text] [--max-output-tokens 48] [--json PATH] [--server-args "..."]

Without ``--target`` it starts ``jitney serve`` with the default model
(SmolLM2-135M-Instruct) plus ``--openai-port`` and a fresh
``--responses-store`` folder (and ``--server-args``), and stops it at the end.

Each turn is one streamed ``POST /v1/responses`` with ``previous_response_id``
(the server's store carries the conversation; the client sends only the new
items), greedy:

tools   a ``lookup(query)`` function tool with ``tool_choice: required``: turn 1
        asks a question; every later turn answers the previous turn's
        ``function_call`` items with ``function_call_output`` items (a
        deterministic ~40-token "search result"), so the loop is tool call ->
        tool result -> tool call ... as an agent's.
text    (before tool calls exist on the chat path, or ``--mode text``) a user
        message per turn instead of the tool results.
auto    tools when the server takes them, else text (said in the report).

Reported per turn: TTFT (request sent -> first output delta: text, reasoning
or tool-call arguments), the whole turn's time, input tokens and how many of
them the prefix cache served (``usage.input_tokens_details.cached_tokens``),
output tokens. The summary: TTFT of turn 1, the median of turns 2..N, the
last turn's over turn 2's, and the least-squares slope of TTFT per 1000 input
tokens over turns 2..N; flat means the prefix cache does the work (only the
new tokens of a turn are prefilled).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.server_harness import free_port, running_server  # noqa: E402

TOOL: Any = {"type": "function", "name": "lookup", "description": "search the knowledge base for a query",
             "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}},
                            "required": ["query"], "additionalProperties": False}, "strict": True}
FIRST = ("You are a research agent. Find out how jitneys (shared taxis) work in five cities, "
         "one lookup at a time.")
CITIES = ("Manila", "Nairobi", "Mexico City", "Istanbul", "Dakar", "Lima", "Cairo", "Jakarta")


@dataclass
class Turn:
    turn: int
    ttft_ms: float
    total_ms: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    tool_calls: int


def tool_result(turn: int, arguments: str) -> str:
    try:
        query = str(json.loads(arguments).get("query", ""))[:60]
    except (ValueError, AttributeError):
        query = arguments[:60]
    city = CITIES[turn % len(CITIES)]
    return (f"Result {turn} for {query!r}: in {city}, shared minibuses run fixed routes, pick up and drop "
            f"off anywhere along them, and charge a flat fare of about {turn + 1} units.")


def one_turn(client: openai.OpenAI, model: str, n: int, body: dict[str, Any]) -> tuple[Turn, Any]:
    started = time.perf_counter()
    first: float | None = None
    final = None
    with client.responses.stream(model=model, temperature=0, **body) as stream:
        for event in stream:
            if first is None and event.type in ("response.output_text.delta",
                                                "response.function_call_arguments.delta",
                                                "response.reasoning_text.delta"):
                first = time.perf_counter()
            if event.type in ("response.completed", "response.incomplete"):   # a turn may hit its limit
                final = event.response
            if event.type in ("response.failed", "error"):
                raise RuntimeError(f"turn {n} failed: {event}")
    if final is None:
        raise RuntimeError(f"turn {n}: the stream ended without its final event")
    end = time.perf_counter()
    usage = final.usage
    assert usage is not None
    calls = [item for item in final.output if item.type == "function_call"]
    return Turn(n, 1000 * ((first or end) - started), 1000 * (end - started), usage.input_tokens,
                usage.input_tokens_details.cached_tokens, usage.output_tokens, len(calls)), final


def tools_work(client: openai.OpenAI, model: str) -> bool:
    try:
        client.responses.create(model=model, input="ping", tools=[TOOL], max_output_tokens=1, store=False)
    except openai.BadRequestError as exc:
        print(f"agent_loop: the server refuses tools ({exc.message}): text turns", file=sys.stderr)
        return False
    return True


def run_loop(client: openai.OpenAI, model: str, turns: int, mode: str, max_output: int) -> list[Turn]:
    out: list[Turn] = []
    previous = None
    for n in range(1, turns + 1):
        body: dict[str, Any] = {"max_output_tokens": max_output}
        if mode == "tools":
            body.update(tools=[TOOL], tool_choice="required")
            if previous is None:
                body["input"] = FIRST
            else:
                calls = [item for item in previous.output if item.type == "function_call"]
                if not calls:
                    raise RuntimeError(f"turn {n - 1} made no tool call: {previous.output}")
                body["input"] = [{"type": "function_call_output", "call_id": c.call_id,
                                  "output": tool_result(n, c.arguments)} for c in calls]
        else:
            city = CITIES[n % len(CITIES)]
            body["input"] = FIRST if previous is None else f"Now tell me about jitneys in {city}, briefly."
        if previous is not None:
            body["previous_response_id"] = previous.id
        turn, previous = one_turn(client, model, n, body)
        out.append(turn)
        print(f"turn {n:2d}: TTFT {turn.ttft_ms:7.1f} ms  total {turn.total_ms:7.1f} ms  input "
              f"{turn.input_tokens:5d} (cached {turn.cached_tokens:5d})  output {turn.output_tokens:3d}"
              f"  tool calls {turn.tool_calls}", flush=True)
    return out


def summary(turns: list[Turn]) -> dict[str, Any]:
    later = turns[1:]
    out: dict[str, Any] = {"turns": len(turns), "ttft_turn1_ms": turns[0].ttft_ms}
    if len(later) >= 2:
        xs = [t.input_tokens / 1000 for t in later]
        ys = [t.ttft_ms for t in later]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        out.update(ttft_median_turns_2_on_ms=statistics.median(ys),
                   ttft_last_over_turn2=later[-1].ttft_ms / later[0].ttft_ms,
                   ttft_ms_per_1k_input_tokens=(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
                                                if var else 0.0),
                   input_tokens_first_last=[turns[0].input_tokens, turns[-1].input_tokens],
                   cached_fraction_turns_2_on=sum(t.cached_tokens for t in later)
                   / max(1, sum(t.input_tokens for t in later)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="the OpenAI base URL of a running server (default: start one)")
    ap.add_argument("--model", default=None, help="the API model name (default: the server's first)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--mode", choices=["auto", "tools", "text"], default="auto")
    ap.add_argument("--max-output-tokens", type=int, default=48)
    ap.add_argument("--server-args", default="", help="more flags for the started `jitney serve`")
    ap.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds the started server may take to serve (a cold CPU start compiles kernels)")
    ap.add_argument("--json", type=Path, default=None, help="write the turns and the summary here")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if ns.target is not None:
            return report(ns, ns.target)
        port = free_port()
        args = ["--openai-port", str(port), "--responses-store", str(Path(tmp) / "store"),
                *shlex.split(ns.server_args)]
        with running_server(args, Path(tmp), startup_timeout=ns.startup_timeout) as server:
            code = report(ns, f"http://127.0.0.1:{port}/v1")
            if "Traceback" in server.log():
                print(server.log(), file=sys.stderr)
            return code


def report(ns: argparse.Namespace, base_url: str) -> int:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = ns.model or client.models.list().data[0].id
    mode = ns.mode if ns.mode != "auto" else ("tools" if tools_work(client, model) else "text")
    print(f"agent_loop: {ns.turns} turns, {mode} mode, model {model}, max_output_tokens {ns.max_output_tokens}")
    turns = run_loop(client, model, ns.turns, mode, ns.max_output_tokens)
    result = {"mode": mode, "model": model, "summary": summary(turns), "turns": [asdict(t) for t in turns]}
    print(json.dumps(result["summary"], indent=2))
    if ns.json is not None:
        ns.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
