#!/usr/bin/env python3
"""Structured output end to end: does the output keep the promise, and what does it cost?

    .venv/bin/python bench/structured_output.py [--target HOST:PORT] [--json PATH]
        [--max-tokens 320] [--seed 1234] [--reps 3] [--free 32] [--companions 16]
        [--free-max-tokens 64] [--server-args "..."]

Without ``--target`` it starts ``jitney serve`` with the default model
(SmolLM2-135M-Instruct, the bundled GGUF) plus ``--server-args``, and stops it
at the end. Three parts, over gRPC like any client:

correctness
    ``SCHEMAS``: JSON schemas (nested objects, arrays with minItems/maxItems,
    enums, const, integers and numbers with bounds, strings with patterns,
    lengths and formats (date, date-time, email, ipv4, uuid), booleans,
    nullable fields, anyOf, required and optional properties, additional
    properties allowed or not, top-level arrays and strings), each with a chat
    prompt asking for such an object. Every schema runs greedy and sampled
    (temperature 0.8, seed ``--seed`` + the schema's index), all in flight at
    once, with ``--max-tokens``. Counted: outputs that ended with
    END_OF_SEQUENCE, LENGTH, or an error status (a request the server failed:
    counted against the guarantee, listed with its seed) and, of the
    END_OF_SEQUENCE ones, how many parse (``json.loads``) and validate
    (``jsonschema``, formats checked where the checker knows them: the report
    lists which). Outputs cut
    by max_tokens must say LENGTH; they are reported apart (the guarantee is
    only for outputs that finished) and are not failures.
throughput
    Does a constrained request slow down the unconstrained ones batched with
    it? ``--free`` unconstrained chat requests (ignore_eos, ``--free-max-tokens``)
    are the measured set: output tokens of those only, divided by the time from
    sending them to the last one's reply. Three arms, all requests of an arm
    sent together:
      alone     the measured set only;
      control   with ``--companions`` more *unconstrained* requests of the same
                prompts and lengths (the batch is as large as in ``masked``);
      masked    with the same companions constrained (a JSON schema that cannot
                finish within the token budget, so they run as long as the
                control's companions and the two batches have the same shape
                step by step).
    ``masked / control`` is the cost of the grammar alone (mask fill in the
    scheduler, the worker waiting for masks and applying them): the measure
    of "unconstrained requests batched with constrained ones lose <= 5%".
    ``masked / alone`` also includes the cost of a batch that is larger by
    the companions, which any extra request has, constrained or not.
    ``--reps`` repetitions, the arms' order rotated each time; medians.
mask cost
    From GetServerStats deltas: grammar_mask_seconds / grammar_masked_steps
    (the scheduler's time filling one step's masks), and the constrained rows
    per masked step, inferred as constrained output tokens / masked steps
    (each constrained token is sampled under one mask row). Per arm of the
    throughput part too, with the steps' mean time for comparison.

Timings depend on what else runs on the machine: the summary records the load
average and CPU count before and after. For where a step's time goes (model
vs the worker's other work, which includes waiting for masks and sampling
under them) add ``--server-args "--trace FILE"`` and compare the arms' steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import running_server  # noqa: E402
from jitney.client.client import FINISH_REASON_NAMES, Sampling, make_params, response_format  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402
from jitney.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

RPC_TIMEOUT = 900.0   # seconds; generous: a loaded 2-core machine is slow


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    schema: dict[str, Any]


def _obj(properties: dict[str, Any], required: list[str] | None = None, *, closed: bool = True) -> dict[str, Any]:
    """An object schema; ``required`` defaults to every property; closed: no other properties.
    Either way it says so: Jitney closes an object schema that does not."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": not closed}


def _str(max_length: int = 40, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length, **kw}


SCHEMAS: list[Case] = [
    Case("person", "Describe a fictional person as a JSON object with name, age and (optionally) email.",
         _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 120},
               "email": {"type": "string", "format": "email", "maxLength": 60}}, ["name", "age"])),
    Case("address", "Give a US postal address as JSON: street, city, a 5-digit zip code and the country.",
         _obj({"street": _str(), "city": _str(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
               "country": {"enum": ["US", "CA", "MX"]}})),
    Case("order", "Return a small online shop order as JSON: an order id like ORD-123456, "
                  "one to three items (sku, quantity, price) and the total.",
         _obj({"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
               "items": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": _obj({"sku": _str(12), "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                                        "price": {"type": "number", "minimum": 0, "maximum": 1000}})},
               "total": {"type": "number", "minimum": 0}})),
    Case("event", "Describe a meeting as JSON: title, date (YYYY-MM-DD), start time (HH:MM) and up to four attendees.",
         _obj({"title": _str(), "date": {"type": "string", "format": "date"},
               "start": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
               "attendees": {"type": "array", "maxItems": 4, "items": _str(20)}})),
    Case("book", "Describe a classic novel as JSON with title, author, publication year and its genres.",
         _obj({"title": _str(60), "author": _str(), "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
               "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                          "items": {"enum": ["fiction", "mystery", "romance", "science fiction",
                                             "fantasy", "history", "poetry"]}}})),
    Case("weather", "Report today's weather in Paris as JSON: temperature in Celsius, condition, humidity and wind.",
         _obj({"city": _str(), "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
               "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
               "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
               "wind": _obj({"speed_kmh": {"type": "number", "minimum": 0, "maximum": 300},
                             "direction": {"enum": ["N", "E", "S", "W"]}})})),
    Case("flags", "Give the settings of a phone app as JSON booleans: dark_mode, notifications and beta.",
         _obj({"dark_mode": {"type": "boolean"}, "notifications": {"type": "boolean"}, "beta": {"type": "boolean"}})),
    Case("nullable", "Describe a user as JSON: first name, middle name (null if none) and nickname (null if none).",
         _obj({"first_name": _str(), "middle_name": {"type": ["string", "null"], "maxLength": 30},
               "nickname": {"anyOf": [_str(20), {"type": "null"}]}})),
    Case("product", "Describe a product for an online store as JSON: name, price, whether it is in stock, "
                    "one to five tags and optionally its dimensions in cm.",
         _obj({"name": _str(), "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
               "in_stock": {"type": "boolean"},
               "tags": {"type": "array", "minItems": 1, "maxItems": 5, "items": _str(15)},
               "dimensions": _obj({"w": {"type": "number", "minimum": 0}, "h": {"type": "number", "minimum": 0},
                                   "d": {"type": "number", "minimum": 0}})},
              ["name", "price", "in_stock", "tags"])),
    Case("review", "Write a short movie review as JSON: the movie, a rating from 1 to 5, "
                   "whether you recommend it and a one-sentence summary.",
         _obj({"movie": _str(), "rating": {"type": "integer", "minimum": 1, "maximum": 5},
               "recommend": {"type": "boolean"}, "summary": _str(160)})),
    Case("coordinates", "Give the latitude and longitude of Tokyo as JSON, with a label.",
         _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
               "lon": {"type": "number", "minimum": -180, "maximum": 180}, "label": _str()}, ["lat", "lon"])),
    Case("recipe", "Give a simple pancake recipe as JSON: name, servings, two to six ingredients "
                   "(item and amount) and whether it is vegetarian.",
         _obj({"name": _str(), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
               "ingredients": {"type": "array", "minItems": 2, "maxItems": 6,
                               "items": _obj({"item": _str(20), "amount": _str(15)})},
               "vegetarian": {"type": "boolean"}})),
    Case("tasks", "List two to four to-do items as a JSON array; each has an id, a title and whether it is done.",
         {"type": "array", "minItems": 2, "maxItems": 4,
          "items": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 100}, "title": _str(30),
                         "done": {"type": "boolean"}})}),
    Case("sentiment", "What is the sentiment of 'I loved this film!'? Answer as a JSON string: "
                      "positive, negative or neutral.",
         {"enum": ["positive", "negative", "neutral"]}),
    Case("employee", "Describe an employee as JSON: id, department, start date (YYYY-MM-DD), salary "
                     "and their manager (an object with a name, or null).",
         _obj({"id": {"type": "integer", "minimum": 1}, "department": {"enum": ["sales", "engineering", "hr", "finance"]},
               "start_date": {"type": "string", "format": "date"},
               "salary": {"type": "number", "minimum": 0, "maximum": 1000000},
               "manager": {"anyOf": [_obj({"name": _str()}), {"type": "null"}]}})),
    Case("config", "Write a service configuration as JSON: a semantic version, debug flag, log level, "
                   "number of retries and the server's IPv4 address.",
         _obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}, "debug": {"type": "boolean"},
               "log_level": {"enum": ["debug", "info", "warning", "error"]},
               "retries": {"type": "integer", "minimum": 0, "maximum": 10},
               "server_ip": {"type": "string", "format": "ipv4"}})),
    Case("contact", "Give contact details as JSON: a phone number like +1-555-123-4567, an email, "
                    "the preferred channel and (optionally) notes.",
         _obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{1,3}-[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
               "email": {"type": "string", "format": "email", "maxLength": 60},
               "preferred": {"enum": ["phone", "email"]}, "notes": _str(80)}, ["phone", "email", "preferred"])),
    Case("flight", "Describe a flight as JSON: flight number like AF1234, origin and destination airport codes "
                   "(three capital letters) and the departure time (ISO 8601 date-time).",
         _obj({"flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
               "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
               "departure": {"type": "string", "format": "date-time"}})),
    Case("matrix", "Give a small matrix of single-digit integers as JSON: an array of two or three rows, "
                   "each with two or three numbers.",
         {"type": "array", "minItems": 2, "maxItems": 3,
          "items": {"type": "array", "minItems": 2, "maxItems": 3,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    Case("invoice", "Write an invoice as JSON: customer (name and a VAT id or null), currency, whether it is "
                    "paid, the due date and one or two lines (description and amount).",
         _obj({"customer": _obj({"name": _str(), "vat_id": {"type": ["string", "null"], "pattern": "^[A-Z]{2}[0-9]{8}$"}}),
               "currency": {"enum": ["EUR", "USD", "GBP"]}, "paid": {"type": "boolean"},
               "due_date": {"type": "string", "format": "date"},
               "lines": {"type": "array", "minItems": 1, "maxItems": 2,
                         "items": _obj({"description": _str(30), "amount": {"type": "number", "minimum": 0}})}})),
    Case("character", "Create a role-playing game character as JSON: name, class, level, stats (str, dex, int "
                      "from 1 to 20) and up to five inventory items.",
         _obj({"name": _str(), "class": {"enum": ["warrior", "mage", "rogue", "cleric"]},
               "level": {"type": "integer", "minimum": 1, "maximum": 99},
               "stats": _obj({k: {"type": "integer", "minimum": 1, "maximum": 20} for k in ("str", "dex", "int")}),
               "inventory": {"type": "array", "maxItems": 5, "items": _str(20)}})),
    Case("api_response", "Write an API response as JSON: status ok or error, an HTTP code, data (an object "
                         "with an integer id, or null) and an optional message.",
         _obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599},
               "data": {"anyOf": [_obj({"id": {"type": "integer"}}), {"type": "null"}]},
               "message": _str(60)}, ["status", "code", "data"])),
    Case("point", "Give a 2D point as JSON with kind 'point' and its x and y coordinates.",
         _obj({"kind": {"const": "point"}, "x": {"type": "number"}, "y": {"type": "number"}})),
    Case("open_object", "Describe a cat as JSON; include at least its name and age, and anything else you like.",
         _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 30}}, closed=False)),
    Case("uuid_record", "Give a database record as JSON: a UUID id, a created date (YYYY-MM-DD) and a status.",
         _obj({"id": {"type": "string", "format": "uuid"}, "created": {"type": "string", "format": "date"},
               "status": {"enum": ["active", "archived"]}})),
]

# The companions of the throughput part: a schema that cannot be finished in
# --free-max-tokens tokens (at least 20 items of several tokens each).
COMPANION_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 20,
    "items": _obj({"id": {"type": "integer", "minimum": 0}, "name": _str(20), "active": {"type": "boolean"}})}

FREE_TOPICS = ["a lighthouse", "a lost key", "a dragon", "the ocean", "a robot", "a garden", "winter", "a train",
               "a library", "a volcano", "a violin", "the moon", "a desert", "a forest", "a city", "a cat",
               "a storm", "a bridge", "a clock", "a river", "a market", "a mountain", "a ship", "a festival",
               "a painter", "a bakery", "a comet", "a castle", "a village", "an island", "a snowman", "a fox"]
COMPANION_ITEMS = ["books", "users", "cities", "planets", "songs", "cars", "fruits", "tools", "birds", "rivers",
                   "games", "movies", "colors", "sports", "trees", "shops"]


# --------------------------------------------------------------------------
# validation

_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's format checker, with a strict RFC 3339 'date-time' where the
    library has none (its own needs rfc3339-validator, not installed)."""
    checker = jsonschema.FormatChecker()
    if "date-time" not in checker.checkers:
        @checker.checks("date-time")
        def _date_time(value: object) -> bool:
            if not isinstance(value, str):
                return True
            if not _RFC3339.match(value):
                return False
            datetime.fromisoformat(value.upper().replace("Z", "+00:00"))   # raises on a bad date/time
            return True
    return checker


def check_output(schema: dict[str, Any], text: str, checker: jsonschema.FormatChecker) -> tuple[bool, bool, str]:
    """(parses, validates, why not) for one finished output."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, False, f"json: {exc}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
    if errors:
        return True, False, "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:3])
    return True, True, ""


# --------------------------------------------------------------------------
# requests


def _stats(stub: pb_grpc.GenerationServiceStub) -> pb.GetServerStatsResponse:
    return stub.GetServerStats(pb.GetServerStatsRequest(), timeout=30)


def _delta(before: pb.GetServerStatsResponse, after: pb.GetServerStatsResponse) -> dict[str, Any]:
    steps = after.steps - before.steps
    masked = after.grammar_masked_steps - before.grammar_masked_steps
    secs = after.grammar_mask_seconds - before.grammar_mask_seconds
    return {"steps": steps, "masked_steps": masked, "mask_seconds": round(secs, 4),
            "mask_ms_per_masked_step": round(1000 * secs / masked, 3) if masked else None,
            "preemptions": after.preemptions - before.preemptions}


def send_all(stub: pb_grpc.GenerationServiceStub, params: list[pb.GenerationParams]
             ) -> tuple[float, list[pb.GenerateResponse | grpc.RpcError], list[float]]:
    """Send every request at once (unary calls on one channel); (start time, replies
    (or the call's error), each reply's arrival time), in ``params`` order."""
    done_at = [0.0] * len(params)
    all_done = threading.Event()
    left = [len(params)]
    lock = threading.Lock()

    def on_done(i: int) -> Any:
        def cb(_fut: Any) -> None:
            done_at[i] = time.monotonic()
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    all_done.set()
        return cb

    start = time.monotonic()
    futures = []
    for i, p in enumerate(params):
        fut = stub.Generate.future(pb.GenerateRequest(params=p), timeout=RPC_TIMEOUT)
        fut.add_done_callback(on_done(i))
        futures.append(fut)
    all_done.wait(RPC_TIMEOUT + 30)
    replies: list[pb.GenerateResponse | grpc.RpcError] = []
    for f in futures:
        try:
            replies.append(f.result())
        except grpc.RpcError as err:
            replies.append(err)
    return start, replies, done_at


def _ok(replies: list[pb.GenerateResponse | grpc.RpcError]) -> list[pb.GenerateResponse]:
    """The replies, or the first error raised (the throughput part needs them all)."""
    for r in replies:
        if isinstance(r, grpc.RpcError):
            raise r
    return replies  # type: ignore[return-value]


def _error(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return f"{code.name if code is not None else 'error'}: {details}"


# --------------------------------------------------------------------------
# parts


def run_correctness(stub: pb_grpc.GenerationServiceStub, *, max_tokens: int, seed: int) -> dict[str, Any]:
    checker = format_checker()

    def sampling(mode: str, i: int) -> Sampling:
        if mode == "greedy":
            return Sampling(max_tokens=max_tokens)
        return Sampling(max_tokens=max_tokens, temperature=0.8, seed=seed + i)

    jobs = [(i, case, mode) for i, case in enumerate(SCHEMAS) for mode in ("greedy", "sampled")]
    params = [make_params(case.prompt, chat=True, sampling=sampling(mode, i),
                          constraint=response_format(json_schema=json.dumps(case.schema)))
              for i, case, mode in jobs]
    before = _stats(stub)
    start, replies, done_at = send_all(stub, params)
    wall = max(done_at) - start
    after = _stats(stub)
    rows: list[dict[str, Any]] = []
    for (i, case, mode), reply in zip(jobs, replies):
        if isinstance(reply, grpc.RpcError):
            rows.append({"schema": case.name, "mode": mode, "finish": "error", "tokens": 0, "text": "",
                         "seed": seed + i if mode == "sampled" else None, "error": _error(reply)})
            continue
        reason = FINISH_REASON_NAMES.get(reply.finish_reason, str(reply.finish_reason))
        row: dict[str, Any] = {"schema": case.name, "mode": mode, "finish": reason,
                               "tokens": reply.usage.completion_tokens, "text": reply.text,
                               "seed": seed + i if mode == "sampled" else None}
        if reply.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE:
            row["parses"], row["valid"], row["error"] = check_output(case.schema, reply.text, checker)
        else:
            row["length_ok"] = (reply.finish_reason == pb.FINISH_REASON_LENGTH
                                and reply.usage.completion_tokens == max_tokens)
        rows.append(row)
    finished = [r for r in rows if r["finish"] == "end_of_sequence"]
    cut = [r for r in rows if r["finish"] not in ("end_of_sequence", "error")]
    errors = [r for r in rows if r["finish"] == "error"]
    delta = _delta(before, after)
    constrained_tokens = sum(r["tokens"] for r in rows)
    delta["constrained_tokens"] = constrained_tokens
    delta["rows_per_masked_step"] = round(constrained_tokens / delta["masked_steps"], 2) if delta["masked_steps"] else None
    delta["mask_us_per_row"] = (round(1e6 * delta["mask_seconds"] / constrained_tokens, 1)
                                if constrained_tokens else None)
    delta["step_ms_mean"] = round(1000 * wall / delta["steps"], 1) if delta["steps"] else None
    return {
        "schemas": len(SCHEMAS), "requests": len(rows), "max_tokens": max_tokens, "seed": seed,
        "wall_seconds": round(wall, 2),
        "end_of_sequence": len(finished), "length": len(cut), "errors": len(errors),
        "length_all_reported_length": all(r.get("length_ok") for r in cut),
        "parsed": sum(r["parses"] for r in finished), "validated": sum(r["valid"] for r in finished),
        "formats_checked": sorted(checker.checkers),
        "failures": [r for r in finished if not r["valid"]],
        "error_requests": [{k: r[k] for k in ("schema", "mode", "seed", "error")} for r in errors],
        "cut_by_max_tokens": [{k: r[k] for k in ("schema", "mode", "finish", "tokens")} for r in cut],
        "mask": delta,
        "outputs": rows,
    }


def _free_params(i: int, max_tokens: int) -> pb.GenerationParams:
    topic = FREE_TOPICS[i % len(FREE_TOPICS)]
    return make_params(f"Write a short story about {topic}.", chat=True,
                       sampling=Sampling(max_tokens=max_tokens, ignore_eos=True))


def _companion_params(i: int, max_tokens: int, constrained: bool) -> pb.GenerationParams:
    item = COMPANION_ITEMS[i % len(COMPANION_ITEMS)]
    prompt = f"List at least twenty {item} as a JSON array of objects with id, name and active."
    constraint = response_format(json_schema=json.dumps(COMPANION_SCHEMA)) if constrained else None
    return make_params(prompt, chat=True, constraint=constraint,
                       sampling=Sampling(max_tokens=max_tokens, ignore_eos=not constrained))


def run_arm(stub: pb_grpc.GenerationServiceStub, arm: str, *, free: int, companions: int,
            max_tokens: int) -> dict[str, Any]:
    measured = [_free_params(i, max_tokens) for i in range(free)]
    extra = [] if arm == "alone" else [_companion_params(i, max_tokens, arm == "masked") for i in range(companions)]
    before = _stats(stub)
    start, got, done_at = send_all(stub, measured + extra)
    after = _stats(stub)
    replies = _ok(got)
    mine = replies[:free]
    tokens = sum(r.usage.completion_tokens for r in mine)
    elapsed = max(done_at[:free]) - start
    companion_tokens = [r.usage.completion_tokens for r in replies[free:]]
    out = {"arm": arm, "measured_tokens": tokens, "seconds": round(elapsed, 3),
           "tokens_per_second": round(tokens / elapsed, 2),
           "companion_tokens": sum(companion_tokens),
           "companions_short": sum(t < max_tokens for t in companion_tokens),
           **_delta(before, after)}
    wall = max(done_at) - start
    out["step_ms_mean"] = round(1000 * wall / out["steps"], 1) if out["steps"] else None
    return out


def run_throughput(stub: pb_grpc.GenerationServiceStub, *, reps: int, free: int, companions: int,
                   max_tokens: int) -> dict[str, Any]:
    # Warm-up: the companions' schema compiled, every prompt's prefix cached.
    send_all(stub, [_free_params(i, 2) for i in range(free)]
             + [_companion_params(i, 2, c) for i in range(companions) for c in (False, True)])
    arms = ["alone", "control", "masked"]
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        order = arms[rep % 3:] + arms[:rep % 3]
        for arm in order:
            result = run_arm(stub, arm, free=free, companions=companions, max_tokens=max_tokens)
            result["rep"] = rep
            runs.append(result)
            print(f"  rep {rep} {arm:8s} {result['tokens_per_second']:8.1f} tok/s of the {free} "
                  f"({result['seconds']:.2f} s, {result['steps']} steps, {result['step_ms_mean']} ms/step, "
                  f"masked steps {result['masked_steps']}, mask {result['mask_ms_per_masked_step']} ms/step)",
                  flush=True)
    med = {arm: statistics.median(r["tokens_per_second"] for r in runs if r["arm"] == arm) for arm in arms}
    def paired(a: str, b: str) -> list[float]:
        """Per repetition: arm a's rate over arm b's (the two ran minutes apart at most)."""
        by_rep = {(r["rep"], r["arm"]): r["tokens_per_second"] for r in runs}
        return [round(by_rep[rep, a] / by_rep[rep, b], 4) for rep in range(reps)]

    masked_runs = [r for r in runs if r["arm"] == "masked"]
    ms_steps = sum(r["masked_steps"] for r in masked_runs)
    return {
        "free": free, "companions": companions, "max_tokens": max_tokens, "reps": reps,
        "median_tokens_per_second": {k: round(v, 2) for k, v in med.items()},
        "ratio_masked_to_control": round(med["masked"] / med["control"], 4),
        "ratio_masked_to_alone": round(med["masked"] / med["alone"], 4),
        "ratio_control_to_alone": round(med["control"] / med["alone"], 4),
        "per_rep_masked_to_control": paired("masked", "control"),
        "per_rep_masked_to_alone": paired("masked", "alone"),
        "median_step_ms": {arm: statistics.median(r["step_ms_mean"] for r in runs if r["arm"] == arm)
                           for arm in arms},
        "mask_ms_per_masked_step": (round(1000 * sum(r["mask_seconds"] for r in masked_runs) / ms_steps, 3)
                                    if ms_steps else None),
        "runs": runs,
    }


# --------------------------------------------------------------------------
# main


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"loadavg": [round(x, 2) for x in load], "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


@contextmanager
def _server(target: str | None, server_args: list[str]) -> Iterator[tuple[str, float | None]]:
    if target:
        yield target, None
        return
    with tempfile.TemporaryDirectory(prefix="jitney-so-") as logs:
        started = time.monotonic()
        with running_server(server_args, Path(logs)) as srv:
            yield srv.target, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--target", help="HOST:PORT of a running server (default: start the default model)")
    ap.add_argument("--server-args", default="", help="extra `jitney serve` arguments when it starts its own")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--free", type=int, default=32)
    ap.add_argument("--companions", type=int, default=16)
    ap.add_argument("--free-max-tokens", type=int, default=64)
    ap.add_argument("--skip", choices=["correctness", "throughput"], action="append", default=[])
    args = ap.parse_args(argv)

    summary: dict[str, Any] = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                               "machine_before": machine()}
    t0 = time.monotonic()
    with _server(args.target, shlex.split(args.server_args)) as (target, startup):
        summary["server_startup_seconds"] = round(startup, 1) if startup is not None else None
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            summary["model"] = {"name": info.model_name, "device": info.device, "dtype": info.dtype,
                                "max_num_seqs": info.max_num_seqs, "batch_invariant": info.batch_invariant}
            print(f"server {target}: {info.model_name} ({info.dtype}, {info.device}); "
                  f"startup {summary['server_startup_seconds']} s; load {summary['machine_before']['loadavg']}",
                  flush=True)
            if "correctness" not in args.skip:
                print(f"correctness: {len(SCHEMAS)} schemas x greedy/sampled, max_tokens {args.max_tokens}", flush=True)
                c = run_correctness(stub, max_tokens=args.max_tokens, seed=args.seed)
                summary["correctness"] = c
                print(f"  {c['requests']} requests in {c['wall_seconds']} s: end_of_sequence {c['end_of_sequence']}, "
                      f"length {c['length']} (all ended LENGTH at max_tokens: {c['length_all_reported_length']}), "
                      f"errors {c['errors']}; "
                      f"of the finished: parse {c['parsed']}/{c['end_of_sequence']}, "
                      f"validate {c['validated']}/{c['end_of_sequence']}", flush=True)
                for cut in c["cut_by_max_tokens"]:
                    print(f"  cut by max_tokens: {cut}")
                for e in c["error_requests"]:
                    print(f"  ERROR {e}")
                for f in c["failures"]:
                    print(f"  INVALID {f['schema']} {f['mode']}: {f['error']}\n    {f['text']!r}")
                m = c["mask"]
                print(f"  masks: {m['masked_steps']} masked steps of {m['steps']}, {m['mask_ms_per_masked_step']} ms "
                      f"per masked step, ~{m['rows_per_masked_step']} constrained rows per masked step, "
                      f"{m['mask_us_per_row']} us per row; mean step {m['step_ms_mean']} ms", flush=True)
            if "throughput" not in args.skip:
                print(f"throughput: {args.free} unconstrained (max_tokens {args.free_max_tokens}, ignore_eos) "
                      f"alone / + {args.companions} unconstrained / + {args.companions} constrained, "
                      f"{args.reps} reps", flush=True)
                t = run_throughput(stub, reps=args.reps, free=args.free, companions=args.companions,
                                   max_tokens=args.free_max_tokens)
                summary["throughput"] = t
                print(f"  medians tok/s: {t['median_tokens_per_second']}; masked/control {t['ratio_masked_to_control']}, "
                      f"masked/alone {t['ratio_masked_to_alone']}, control/alone {t['ratio_control_to_alone']}; "
                      f"per rep masked/control {t['per_rep_masked_to_control']}; "
                      f"median step ms {t['median_step_ms']}; "
                      f"mask {t['mask_ms_per_masked_step']} ms per masked step ({args.companions} rows)", flush=True)
    summary["machine_after"] = machine()
    summary["total_seconds"] = round(time.monotonic() - t0, 1)
    print(f"total {summary['total_seconds']} s; load before {summary['machine_before']['loadavg']}, "
          f"after {summary['machine_after']['loadavg']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
