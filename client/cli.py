"""The client side of the `jitney` command: generate, health, bench.

Imports only the public API (``jitney.v1`` through ``jitney.client``);
``jitney.cli`` adds these subcommands next to the server's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import grpc

from jitney.client.channel import API_KEY_ENV, TlsFiles, api_key_from, open_channel


def _connection_arguments(parser: argparse.ArgumentParser, *, api_key: bool = True) -> None:
    """--target, TLS and (unless health) the API key: the same for every command."""
    parser.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    g = parser.add_argument_group("connection security")
    g.add_argument("--tls", action="store_true",
                   help="connect over TLS, verified with the system's CA roots (implied by --tls-*)")
    g.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM CA certificates that verify the server")
    g.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM client certificate, for a server that requires one (with --tls-key)")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    if api_key:
        g.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"API key sent as `authorization: Bearer KEY` (default: ${API_KEY_ENV}; "
                            "the variable keeps it out of the process list)")


def _tls(ns: argparse.Namespace) -> TlsFiles | None:
    """The TLS settings of the flags (None: plaintext). Raises ValueError."""
    if (ns.tls_cert is None) != (ns.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if not (ns.tls or ns.tls_ca or ns.tls_cert):
        return None
    return TlsFiles(ns.tls_ca, ns.tls_cert, ns.tls_key)


def _connect(ns: argparse.Namespace) -> tuple[TlsFiles | None, str | None]:
    """TLS settings with their files read once (an error here, not at the first call),
    and the API key. Raises ValueError or OSError."""
    tls = _tls(ns)
    if tls is not None:
        tls.credentials()
    return tls, api_key_from(getattr(ns, "api_key", None))


def _generate_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt", help="the prompt text")
    _connection_arguments(gen)
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None, help="(0, 10], 1 = off")
    gen.add_argument("--presence-penalty", type=float, default=None, help="[-2, 2]")
    gen.add_argument("--frequency-penalty", type=float, default=None, help="[-2, 2]")
    gen.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                     help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    gen.add_argument("--min-tokens", type=int, default=None)
    gen.add_argument("--logprobs", action="store_true",
                     help="with --json: each generated token's logprob and text (implied by --top-logprobs)")
    gen.add_argument("--top-logprobs", type=int, default=None,
                     help="with --json: also the N most likely tokens at each step")
    gen.add_argument("--prompt-logprobs", type=int, default=None,
                     help="with --json: each prompt token's logprob and text, and N alternatives")
    gen.add_argument("-n", "--n", type=int, default=None, help="number of samples (1..16)")
    fmt = gen.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", default=None, metavar="SCHEMA|@FILE", help="output matches this JSON schema")
    fmt.add_argument("--json-object", action="store_true", help="output is a JSON object")
    fmt.add_argument("--regex", default=None, help="output matches this regular expression")
    fmt.add_argument("--choice", action="append", default=[], help="output is one of these (repeatable)")
    fmt.add_argument("--grammar", default=None, metavar="EBNF|@FILE", help="output matches this EBNF grammar")
    gen.add_argument("--lenient-json", action="store_true",
                     help="with --json-schema or --json-object: the schema's own semantics (objects without "
                          "additionalProperties stay open) and whitespace between tokens, instead of compact "
                          "output with closed objects")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON document at the end instead of streaming: every sample's text, "
                          "token ids, finish reason and (if asked) logprobs, prompt logprobs, usage")
    gen.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")


def _health_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    health = sub.add_parser("health", help="exit 0 when the server reports SERVING (for probes; "
                                           "health needs no API key, over TLS too)")
    _connection_arguments(health, api_key=False)
    health.add_argument("--timeout", type=float, default=3.0)


def cmd_health(ns: argparse.Namespace, tls: TlsFiles | None) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(ns.target, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=ns.timeout)
        except grpc.RpcError as err:
            print(f"jitney: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    bench = sub.add_parser("bench", help="replay a workload (JSONL) against a running server")
    _connection_arguments(bench)
    bench.add_argument("--workload", type=Path, required=True, help="JSONL file, one request a line")
    bench.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    bench.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_generate(ns: argparse.Namespace, tls: TlsFiles | None, api_key: str | None) -> int:
    from jitney.client.client import FINISH_REASON_NAMES, JitneyClient, Sampling, make_params, response_format

    try:
        bias = {int(k): float(v) for k, v in (item.split("=", 1) for item in ns.logit_bias)}
    except ValueError:
        print(f"jitney: --logit-bias takes ID=BIAS, got {ns.logit_bias}", file=sys.stderr)
        return 2
    # Set, 0 included, it also brings each generated token's text.
    top_logprobs = ns.top_logprobs if ns.top_logprobs is not None else (0 if ns.logprobs else None)
    sampling = Sampling(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed,
                        max_tokens=ns.max_tokens, stop=ns.stop, stop_token_ids=ns.stop_token_id,
                        ignore_eos=ns.ignore_eos, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
                        logit_bias=bias, min_tokens=ns.min_tokens, top_logprobs=top_logprobs,
                        prompt_logprobs=ns.prompt_logprobs, n=ns.n)
    constraint = response_format(json_schema=_text_or_file(ns.json_schema), json_object=ns.json_object,
                                 regex=ns.regex, choices=ns.choice, grammar=_text_or_file(ns.grammar))
    if ns.lenient_json:
        if constraint is None or constraint.WhichOneof("format") not in ("json_schema", "json_object"):
            print("jitney: --lenient-json goes with --json-schema or --json-object", file=sys.stderr)
            return 2
        constraint.lenient_json = True
    params = make_params(ns.prompt, chat=ns.chat, sampling=sampling, constraint=constraint)
    n = ns.n or 1
    result = _Result(n, logprobs=ns.logprobs or ns.top_logprobs is not None, top=ns.top_logprobs or 0,
                     prompt_top=ns.prompt_logprobs or 0)
    relay = None if ns.json or n == 1 else _SampleRelay(n, sys.stdout)
    with JitneyClient(ns.target, tls=tls, api_key=api_key) as client:
        try:
            for msg in client.generate_stream(params, timeout=ns.timeout):
                result.add(msg)
                if ns.json:
                    continue
                if relay is None:
                    print(msg.text, end="", flush=True)
                    continue
                relay.text(msg.sample_index, msg.text)
                if msg.finish_reason:
                    relay.finish(msg.sample_index, FINISH_REASON_NAMES.get(msg.finish_reason, "unspecified"))
        except grpc.RpcError as err:
            print(f"\njitney: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if ns.json:
        print(json.dumps(result.document(), ensure_ascii=False))
    elif relay is None:
        print()
    return 0


class _SampleRelay:
    """Prints the text of n samples as it arrives, one sample at a time, so
    that samples generated side by side do not interleave on the terminal:
    the lowest-numbered sample not yet printed streams live; the others are
    held until their turn (then their text so far at once, and on live).

        --- sample 0 ---
        ...text...
        --- end of sample 0 (length) ---
        --- sample 1 ---
    """

    def __init__(self, n: int, out: Any) -> None:
        self.out = out
        self.held = [""] * n
        self.reasons: list[str | None] = [None] * n
        self.live = -1          # the sample now printing; -1: none yet
        self.at_line_start = True

    def text(self, index: int, text: str) -> None:
        if self.live < 0:
            self._start(0)
        if index == self.live:
            self._write(text)
        else:
            self.held[index] += text

    def finish(self, index: int, reason: str) -> None:
        if self.live < 0:
            self._start(0)
        self.reasons[index] = reason
        while self.live < len(self.held) and self.reasons[self.live] is not None:
            self._write("" if self.at_line_start else "\n")
            self._write(f"--- end of sample {self.live} ({self.reasons[self.live]}) ---\n")
            if self.live + 1 < len(self.held):
                self._start(self.live + 1)
            else:
                self.live += 1

    def _start(self, index: int) -> None:
        self.live = index
        self._write(f"--- sample {index} ---\n")
        self._write(self.held[index])
        self.held[index] = ""

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")


def _logprob(value: float) -> float | None:
    """JSON has no infinities: a -inf logprob (a token the model rules out) is null."""
    return value if math.isfinite(value) else None


def _alternatives(top: Any) -> list[dict[str, Any]]:
    """A TopLogprobs as [{token_id, token, logprob}] (token null from a server that sends no texts)."""
    texts = list(top.tokens) or [None] * len(top.token_ids)
    return [{"token_id": t, "token": text, "logprob": _logprob(lp)}
            for t, text, lp in zip(top.token_ids, texts, top.logprobs)]


class _Result:
    """Everything a GenerateStream call returned, as the one JSON document of
    `jitney generate --json` (its shape: README, "Use it"). ``logprobs``: each
    sample gets a per-token ``logprobs`` list (``top`` alternatives each, when
    > 0); ``prompt_top``: the prompt's alternatives per token."""

    def __init__(self, n: int, *, logprobs: bool, top: int, prompt_top: int) -> None:
        self.logprobs, self.top, self.prompt_top = logprobs, top, prompt_top
        self.samples: list[dict[str, Any]] = []
        for i in range(n):
            sample: dict[str, Any] = {"index": i, "text": "", "token_ids": [], "finish_reason": "unspecified"}
            if logprobs:
                sample["logprobs"] = []
            self.samples.append(sample)
        self.request_id = ""
        self.prompt_logprobs: list[dict[str, Any]] | None = None
        self.usage: dict[str, int] = {}

    def add(self, msg: Any) -> None:
        from jitney.client.client import FINISH_REASON_NAMES

        self.request_id = msg.request_id
        sample = self.samples[msg.sample_index]
        sample["text"] += msg.text
        sample["token_ids"].extend(msg.token_ids)
        if self.logprobs:
            texts = list(msg.tokens) or [None] * len(msg.token_ids)
            for i, (token, text, lp) in enumerate(zip(msg.token_ids, texts, msg.logprobs)):
                entry: dict[str, Any] = {"token_id": token, "token": text, "logprob": _logprob(lp)}
                if self.top:
                    entry["top_logprobs"] = _alternatives(msg.top_logprobs[i]) if i < len(msg.top_logprobs) else []
                sample["logprobs"].append(entry)
        if msg.finish_reason:
            sample["finish_reason"] = FINISH_REASON_NAMES.get(msg.finish_reason, "unspecified")
        if msg.prompt_logprobs:
            self.prompt_logprobs = []
            for p in msg.prompt_logprobs:
                entry = {"token_id": p.token_id, "token": p.token or None,
                         "logprob": _logprob(p.logprob) if p.HasField("logprob") else None}
                if self.prompt_top:
                    entry["top_logprobs"] = _alternatives(p.top)
                self.prompt_logprobs.append(entry)
        if msg.HasField("usage"):
            self.usage = {"prompt_tokens": msg.usage.prompt_tokens,
                          "completion_tokens": msg.usage.completion_tokens,
                          "cached_prompt_tokens": msg.usage.cached_prompt_tokens}

    def document(self) -> dict[str, Any]:
        first = self.samples[0]
        doc: dict[str, Any] = {"request_id": self.request_id, "text": first["text"], "token_ids": first["token_ids"],
                               "finish_reason": first["finish_reason"], "samples": self.samples}
        if self.prompt_logprobs is not None:
            doc["prompt_logprobs"] = self.prompt_logprobs
        doc["usage"] = self.usage
        return doc


def _text_or_file(value: str | None) -> str | None:
    """A flag's value, or the contents of the file it names as @FILE."""
    if value is not None and value.startswith("@"):
        return Path(value[1:]).read_text()
    return value


def run(ns: argparse.Namespace) -> int:
    """Run the client subcommand ``ns.command`` (generate, health or bench)."""
    try:
        tls, api_key = _connect(ns)
    except (ValueError, OSError) as exc:
        print(f"jitney {ns.command}: {exc}", file=sys.stderr)
        return 2
    if ns.command == "generate":
        return cmd_generate(ns, tls, api_key)
    if ns.command == "health":
        return cmd_health(ns, tls)
    from jitney.client.bench import run_bench

    return run_bench(ns.target, ns.workload, ns.json, ns.max_concurrency, not ns.no_progress,
                     tls=tls, api_key=api_key)


def add_client_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The generate, health and bench subcommands."""
    _generate_parser(sub)
    _health_parser(sub)
    _bench_parser(sub)


CLIENT_COMMANDS = ("generate", "health", "bench")
