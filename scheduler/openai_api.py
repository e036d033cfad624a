"""The OpenAI-compatible HTTP door of the scheduler process (``--openai-port``).

An aiohttp server in the scheduler's own asyncio loop, beside the gRPC
server, over the same Engine: every request becomes a
``jitney.v1.GenerationParams`` and goes through the gRPC path's own
``GenerationServicer.admit`` (validation, the response format's grammar,
``Engine.submit``, metrics), so limits, queue bounds, deadlines,
cancellation, metrics and the request log are the same.

    GET  /v1/models, /v1/models/{id}    the served model (owned_by "jitney")
    POST /v1/completions                one prompt: text or token ids
    POST /v1/chat/completions           chat messages (text content)
    GET  /health                        200 while serving, else 503

``stream: true`` answers server-sent events, ``data: {chunk}`` ... then
``data: [DONE]``. Headers go out with the first generated token, so a
request that fails before any (a deadline while queued, a lost worker) still
gets its HTTP status; an error after that arrives as one
``data: {"error": ...}`` event, then ``data: [DONE]``.

Decisions (the OpenAI API leaves them to the server, or Jitney differs):
  * ``model`` may be left out; when given it must be one of the served
    model's names (``--served-model-name``, repeatable; default the model's
    own; all listed by /v1/models), else 404 ``model_not_found``, as OpenAI
    and vLLM answer. Responses carry the first (primary) name, as vLLM's.
  * Defaults follow OpenAI, not Jitney's gRPC: ``temperature`` 1, and a
    completion's ``max_tokens`` 16 (chat: up to the context length); the
    model's generation config (``--generation-config``) replaces them, and
    the other sampling defaults, where it sets a value.
  * Every request argument is either honoured or refused with 400 naming
    it: OpenAI's arguments that Jitney lacks (tools, audio, ...) say "is not
    supported", unknown ones "Unrecognized request argument". A JSON
    ``null`` is the same as leaving an argument out. ``user`` is accepted
    and not used (OpenAI uses it for abuse monitoring only).
  * One prompt per completion request (a list of several is refused); chat
    content is a string or text parts (joined with newlines); role
    ``developer`` is ``system``; tool and function messages are refused.
  * vLLM's extra arguments: ``top_k`` (-1 or 0 = off), ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
    ``stop_token_ids``, and Jitney's ``priority`` and ``cache_salt``.
  * Deadline: the optional ``X-Request-Timeout`` header (seconds), capped by
    ``--max-request-seconds`` as a gRPC deadline is; past it: 504.
  * Token strings in logprobs are the token decoded alone.

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``:
400 invalid request (the message and ``param`` name the OpenAI argument),
401 a missing or unknown API key (``--api-key-file``; every route but
``/health``, key sent as ``Authorization: Bearer KEY``), 404 unknown model or
path, 429 a queue bound (``--max-queued-*``) or the key's
``--max-requests-per-key``, 503 not ready, worker lost or draining, 504
deadline, 500 a worker failure. With ``--tls-cert`` the door speaks HTTPS
with the gRPC port's certificate (and client CA).
"""

from __future__ import annotations

import json
import logging
import math
import re
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jitney.v1 import generation_pb2 as pb
from jitney.scheduler.engine import RequestHandle, StreamEvent
from jitney.scheduler.metrics import Metrics, RequestRecord, request_log
from jitney.scheduler.request import FinishReason
from jitney.scheduler.auth import bearer_token
from jitney.scheduler.config import SamplingDefaults
from jitney.scheduler.detokenizer import TokenTexts
from jitney.scheduler.security import ApiKeys
from jitney.scheduler.server import GenerationServicer, RequestRefused, ServingState

log = logging.getLogger("jitney.scheduler")

MAX_BODY_BYTES = 16 * 1024 * 1024          # as the gRPC port's message limit
TIMEOUT_HEADER = "X-Request-Timeout"
COMPLETION_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
UINT32_MAX = 2**32 - 1

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.END_OF_SEQUENCE: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
}

# gRPC status (an engine event's error_code) -> HTTP status.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "INTERNAL": 500,
}

ERROR_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    503: "service_unavailable_error", 504: "timeout_error",
}
ERROR_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable", 504: "deadline_exceeded",
               500: "internal_error"}

# Arguments both endpoints take.
_COMMON_ARGS = frozenset({
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "response_format", "user",
    # vLLM's extras, and Jitney's own
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "priority", "cache_salt",
})
_CHAT_ARGS = _COMMON_ARGS | {"messages", "max_completion_tokens", "top_logprobs"}
_COMPLETION_ARGS = _COMMON_ARGS | {"prompt", "echo", "best_of", "suffix"}

# OpenAI arguments Jitney does not implement: refused unless null or one of
# the values that ask for nothing (the API's own defaults).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": ((),), "tool_choice": ("none",), "functions": ((),), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "audio": (), "modalities": (("text",),), "prediction": (),
    "reasoning_effort": (), "web_search_options": (), "store": (False,), "metadata": (),
    "service_tier": ("auto", "default"), "verbosity": (), "prompt_cache_key": (),
    "prompt_cache_retention": (), "safety_identifier": (),
}

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Message keys allowed when null or empty (clients echo assistant turns back).
_EMPTY_MESSAGE_KEYS = frozenset({"tool_calls", "function_call", "refusal", "audio", "annotations"})


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else ERROR_CODES.get(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, dumps=_dumps)


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


# -- request parsing ------------------------------------------------------


@dataclass
class ParsedRequest:
    """An OpenAI request as Jitney runs it."""

    params: pb.GenerationParams
    chat: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False        # return the sampled tokens' logprobs
    top_logprobs: int = 0
    echo: bool = False            # completions: the prompt before each choice's text
    # proto field name -> the OpenAI argument the request used for it
    names: dict[str, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        s = self.params.sampling
        return s.n if s.HasField("n") else 1


def parse_request(body: Any, *, chat: bool, defaults: SamplingDefaults | None = None) -> ParsedRequest:
    """Translate a chat or completion request body; raises APIError (400).
    Where ``defaults`` (the generation config's) has a value, OpenAI's own
    default is left out: the servicer fills it in."""
    defaults = defaults or SamplingDefaults()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    args = {k: v for k, v in body.items() if v is not None}
    allowed = _CHAT_ARGS if chat else _COMPLETION_ARGS
    for key, value in args.items():
        if key in allowed:
            continue
        if key in _UNSUPPORTED:
            if _is_empty_value(value, _UNSUPPORTED[key]):
                continue
            raise _bad(key, "is not supported by Jitney", code="unsupported_parameter")
        raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key,
                       code="unknown_parameter")
    out = ParsedRequest(pb.GenerationParams(), chat)
    p, s = out.params, out.params.sampling
    if chat:
        _chat_messages(args, p)
    else:
        _completion_prompt(args, p)
    out.stream = _bool(args, "stream") or False
    options = args.get("stream_options")
    if options is not None:
        if not out.stream:
            raise _bad("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict):
            raise _bad("stream_options", "must be an object")
        for key in options:
            if key != "include_usage" and options[key] is not None:
                raise _bad(f"stream_options.{key}", "is not supported by Jitney",
                           code="unsupported_parameter")
        out.include_usage = _bool(options, "include_usage", "stream_options.") or False
    _max_tokens(args, s, out, defaults)
    temperature = _number(args, "temperature")
    if temperature is not None or defaults.temperature is None:
        s.temperature = 1.0 if temperature is None else temperature
    _set(s, "top_p", _number(args, "top_p"))
    _set(s, "n", _int(args, "n", 0, UINT32_MAX))
    best_of = _int(args, "best_of", 0, UINT32_MAX)
    if best_of is not None and best_of != out.n:
        raise _bad("best_of", "is not supported by Jitney (only best_of = n)",
                   code="unsupported_parameter")
    if "suffix" in args:
        raise _bad("suffix", "is not supported by Jitney", code="unsupported_parameter")
    s.stop.extend(_stop(args))
    _set(s, "seed", _int(args, "seed", 0, 2**64 - 1))
    _set(s, "presence_penalty", _number(args, "presence_penalty"))
    _set(s, "frequency_penalty", _number(args, "frequency_penalty"))
    for token, bias in _logit_bias(args).items():
        s.logit_bias[token] = bias
    _logprobs(args, s, out)
    out.echo = (not chat) and (_bool(args, "echo") or False)
    if out.echo and out.logprobs:
        raise _bad("echo", "together with logprobs is not supported by Jitney",
                   code="unsupported_parameter")
    _response_format(args, p)
    top_k = _int(args, "top_k", -1, UINT32_MAX)
    _set(s, "top_k", None if top_k is None else max(top_k, 0))   # vLLM: -1 = off
    _set(s, "min_p", _number(args, "min_p"))
    _set(s, "repetition_penalty", _number(args, "repetition_penalty"))
    _set(s, "min_tokens", _int(args, "min_tokens", 0, UINT32_MAX))
    s.ignore_eos = _bool(args, "ignore_eos") or False
    s.stop_token_ids.extend(_int_list(args, "stop_token_ids", 0, UINT32_MAX))
    _set(p, "priority", _int(args, "priority", -2**31, 2**31 - 1))
    p.cache_salt = _str(args, "cache_salt") or ""
    _str(args, "user")
    return out


def _is_empty_value(value: Any, empties: tuple[Any, ...]) -> bool:
    normal = tuple(value) if isinstance(value, list) else value
    return any(normal == e and type(normal) is type(e) for e in empties)


def _set(message: Any, name: str, value: Any) -> None:
    if value is not None:
        setattr(message, name, value)


def _chat_messages(args: Mapping[str, Any], p: pb.GenerationParams) -> None:
    messages = args.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "is required: a list of messages")
    p.chat.SetInParent()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{where}.role", "is required: a string")
        if role not in _CHAT_ROLES:
            raise _bad(f"{where}.role", f"{role[:32]!r} is not supported by Jitney "
                       f"(roles: {', '.join(_CHAT_ROLES)})", code="unsupported_value")
        for key, value in m.items():
            if key in ("role", "content") or value is None:
                continue
            if key in _EMPTY_MESSAGE_KEYS and value in ([], ""):
                continue
            raise _bad(f"{where}.{key}", "is not supported by Jitney", code="unsupported_parameter")
        p.chat.messages.add(role=_CHAT_ROLES[role], content=_content(m.get("content"), where))


def _content(content: Any, where: str) -> str:
    if content is None:
        raise _bad(f"{where}.content", "is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{where}.content[{j}]", "must be an object with a type")
        if part["type"] != "text":
            raise _bad(f"{where}.content[{j}].type", f"{part['type'][:32]!r} is not supported by "
                       "Jitney (text parts only)", code="unsupported_value")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content[{j}].text", "is required: a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _completion_prompt(args: Mapping[str, Any], p: pb.GenerationParams) -> None:
    prompt = args.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) != 1:
            raise _bad("prompt", "a batch of prompts is not supported by Jitney: send one "
                       "prompt per request", code="unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        p.text = prompt
    elif isinstance(prompt, list) and all(_is_int(x) for x in prompt):
        for i, t in enumerate(prompt):
            if not 0 <= t <= UINT32_MAX:
                raise _bad(f"prompt[{i}]", f"token id {t} is not a valid token id")
        p.token_ids.ids.extend(prompt)
        p.token_ids.SetInParent()
    else:
        raise _bad("prompt", "is required: a string or a list of token ids")


def _max_tokens(args: Mapping[str, Any], s: pb.SamplingParams, out: ParsedRequest,
                defaults: SamplingDefaults) -> None:
    value = _int(args, "max_tokens", 0, UINT32_MAX)
    name = "max_tokens"
    if out.chat:
        newer = _int(args, "max_completion_tokens", 0, UINT32_MAX)
        if newer is not None:
            if value is not None and value != newer:
                raise _bad("max_completion_tokens", "differs from max_tokens: give one of them")
            value, name = newer, "max_completion_tokens"
    elif value is None and defaults.max_tokens is None:
        value = COMPLETION_DEFAULT_MAX_TOKENS
    out.names["max_tokens"] = name
    _set(s, "max_tokens", value)


def _stop(args: Mapping[str, Any]) -> list[str]:
    stop = args.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return stop
    raise _bad("stop", "must be a string or a list of strings")


def _logit_bias(args: Mapping[str, Any]) -> dict[int, float]:
    bias = args.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _bad("logit_bias", "must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d{1,10}", key) or int(key) > UINT32_MAX:
            raise _bad("logit_bias", f"key {key[:32]!r} is not a token id")
        value = _number(bias, key, "logit_bias.")
        if value is None:
            raise _bad(f"logit_bias.{key}", "must be a number")
        out[int(key)] = value
    return out


def _logprobs(args: Mapping[str, Any], s: pb.SamplingParams, out: ParsedRequest) -> None:
    if out.chat:
        out.logprobs = _bool(args, "logprobs") or False
        top = _int(args, "top_logprobs", 0, UINT32_MAX)
        if top is not None and not out.logprobs:
            raise _bad("top_logprobs", "needs logprobs set to true")
        out.names["top_logprobs"] = "top_logprobs" if top is not None else "logprobs"
    else:
        top = _int(args, "logprobs", 0, UINT32_MAX)
        out.logprobs = top is not None
        out.names["top_logprobs"] = "logprobs"
    if out.logprobs:
        out.top_logprobs = top or 0
        s.top_logprobs = out.top_logprobs


def _response_format(args: Mapping[str, Any], p: pb.GenerationParams) -> None:
    fmt = args.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise _bad("response_format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        p.response_format.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema", "is required: an object with a schema")
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise _bad("response_format.json_schema.schema", "is required: a JSON Schema object")
        p.response_format.json_schema = json.dumps(schema)
        # Unset or true: compact output, objects closed unless they say otherwise
        # (what OpenAI's strict mode guarantees). false: the schema's own meaning.
        if _bool(spec, "strict", prefix="response_format.json_schema.") is False:
            p.response_format.lenient_json = True
    else:
        raise _bad("response_format.type", f"{str(kind)[:32]!r} is not supported by Jitney "
                   "(text, json_object, json_schema)", code="unsupported_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(args: Mapping[str, Any], key: str, low: int, high: int, prefix: str = "") -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise _bad(prefix + key, "must be an integer")
    if not low <= value <= high:
        raise _bad(prefix + key, f"must be in [{low}, {high}], got {value}")
    return int(value)


def _int_list(args: Mapping[str, Any], key: str, low: int, high: int) -> list[int]:
    value = args.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(key, "must be a list of integers")
    out = []
    for i, v in enumerate(value):
        checked = _int({key: v}, key, low, high) if v is not None else None
        if checked is None:
            raise _bad(f"{key}[{i}]", "must be an integer")
        out.append(checked)
    return out


def _number(args: Mapping[str, Any], key: str, prefix: str = "") -> float | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(prefix + key, "must be a number")
    return float(value)


def _bool(args: Mapping[str, Any], key: str, prefix: str = "") -> bool | None:
    value = args.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(prefix + key, "must be true or false")
    return value


def _str(args: Mapping[str, Any], key: str) -> str | None:
    value = args.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(key, "must be a string")
    return value


def openai_param(proto_field: str, parsed: ParsedRequest) -> str:
    """The OpenAI argument of a validation error's proto field path."""
    rest = proto_field.removeprefix("params.")
    if rest.startswith("sampling."):
        rest = rest.removeprefix("sampling.")
        head, sep, tail = rest.partition("[")
        return parsed.names.get(head, head) + sep + tail
    if rest.startswith("chat.messages"):
        return rest.removeprefix("chat.")
    if rest.startswith("chat"):
        return "messages"
    if rest.startswith("response_format.json_schema"):
        return "response_format.json_schema.schema"
    if rest.startswith(("text", "token_ids", "prompt")):
        index = re.search(r"\[\d+\]$", rest)
        return "prompt" + (index.group(0) if index else "")
    return rest.split(".")[0]


# -- responses ------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def usage_dict(event: StreamEvent) -> dict[str, Any]:
    return {"prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_prompt_tokens}}


@dataclass
class _Choice:
    """One choice as it accumulates (a non-streamed answer) or streams."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0          # completions' logprobs.text_offset so far
    started: bool = False         # streaming: its first chunk went out


class _Formatter:
    """Builds the JSON of one request's answer, chunks or whole."""

    def __init__(self, parsed: ParsedRequest, response_id: str, model: str,
                 token_text: TokenTexts, echo_text: str) -> None:
        self.parsed = parsed
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.echo_text = echo_text

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.parsed.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, choice: _Choice, ids: list[int], lps: list[float],
                 tops: list[list[tuple[int, float]]]) -> dict[str, Any] | None:
        if not self.parsed.logprobs:
            return None
        want_top = self.parsed.top_logprobs
        tops = tops + [[] for _ in range(len(ids) - len(tops))]
        if self.parsed.chat:
            content = []
            for token, lp, top in zip(ids, lps, tops):
                text = self.token_text(token)
                content.append({
                    "token": text, "logprob": _logprob(lp), "bytes": self.token_text.raw(token),
                    "top_logprobs": [{"token": self.token_text(t), "logprob": _logprob(v),
                                      "bytes": self.token_text.raw(t)}
                                     for t, v in top[:want_top]]})
            return {"content": content, "refusal": None}
        texts = [self.token_text(t) for t in ids]
        offsets = []
        for text in texts:
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        top_dicts = ([{self.token_text(t): _logprob(v) for t, v in top[:want_top]} for top in tops]
                     if want_top else None)
        return {"tokens": texts, "token_logprobs": [_logprob(v) for v in lps],
                "top_logprobs": top_dicts, "text_offset": offsets}

    # -- whole answers
    def full(self, choices: list[_Choice], usage: dict[str, Any] | None) -> dict[str, Any]:
        out = self._head(stream=False)
        items = []
        for c in choices:
            lp = self.logprobs(c, c.token_ids, c.logprobs, c.top)
            if self.parsed.chat:
                items.append({"index": c.index, "finish_reason": c.finish_reason, "logprobs": lp,
                              "message": {"role": "assistant", "content": c.text, "refusal": None}})
            else:
                items.append({"index": c.index, "finish_reason": c.finish_reason, "logprobs": lp,
                              "text": self.echo_text + c.text})
        out["choices"] = items
        out["usage"] = usage
        return out

    # -- streamed chunks
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._head(stream=True)
        out["choices"] = choices
        if self.parsed.include_usage:
            out["usage"] = None
        return out

    def _choice_chunk(self, index: int, text: str | None, logprobs: Any,
                      finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        if self.parsed.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason}])
        return self._chunk([{"index": index, "text": text or "", "logprobs": logprobs,
                             "finish_reason": finish_reason}])

    def chunks(self, choice: _Choice, event: StreamEvent) -> list[dict[str, Any]]:
        out = []
        if not choice.started:
            choice.started = True
            if self.parsed.chat:
                out.append(self._choice_chunk(choice.index, "", None, None, role=True))
            elif self.echo_text:
                out.append(self._choice_chunk(choice.index, self.echo_text, None, None))
                choice.text_offset = len(self.echo_text)
        lp = self.logprobs(choice, list(event.token_ids), list(event.logprobs),
                           list(event.top_logprobs))
        if event.text or (lp is not None and event.token_ids):
            out.append(self._choice_chunk(choice.index, event.text, lp, None))
        if event.finish_reason is not None:
            reason = FINISH_REASONS.get(event.finish_reason, "stop")
            out.append(self._choice_chunk(choice.index, None if self.parsed.chat else "", None,
                                          reason))
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        out = self._head(stream=True)
        out["choices"] = []
        out["usage"] = usage
        return out


# -- the server -----------------------------------------------------------


class OpenAIServer:
    """The HTTP door over ``servicer``'s serving state (shared with gRPC);
    with ``keys``, every route but /health needs one of them."""

    def __init__(self, servicer: GenerationServicer, keys: ApiKeys | None = None) -> None:
        self.servicer = servicer
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        middlewares = [_json_errors] + ([_authenticate(keys, servicer.metrics)] if keys is not None else [])
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_get("/v1/models/{model:.+}", self.get_model)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/health", self.health)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: any free port), HTTPS with ``ssl_context``;
        the port bound. Raises OSError."""
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose ``finally`` cancels the request (as a gRPC cancel does).
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- state ---------------------------------------------------------------
    def _serving(self) -> ServingState:
        state, refusing = self.servicer.state, self.servicer.refusing
        if state is None or refusing is not None:
            raise APIError(503, refusing or "the worker is not ready yet")
        return state

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jitney"}

    # -- routes --------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        self._serving()
        return web.json_response({"status": "serving"})

    async def list_models(self, request: web.Request) -> web.Response:
        state = self._serving()
        return web.json_response({"object": "list",
                                  "data": [self._model_entry(n) for n in self.servicer.served_names(state)]})

    async def get_model(self, request: web.Request) -> web.Response:
        state = self._serving()
        name = request.match_info["model"]
        names = self.servicer.served_names(state)
        if name not in names:
            raise _model_not_found(name, names)
        return web.json_response(self._model_entry(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # -- generation ----------------------------------------------------------
    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        timeout = _timeout(request)
        state = self._serving()
        parsed = parse_request(body, chat=chat, defaults=self.servicer.sampling_defaults)
        model = body.get("model")
        names = self.servicer.served_names(state)
        if model is not None and model not in names:
            raise _model_not_found(str(model), names)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        parsed.params.request_id = response_id
        handle, record, prompt_ids = await self._submit(state, parsed, timeout, request.get(KEY_NAME))
        try:
            echo = _echo_text(parsed, prompt_ids, state.tokenizer) if parsed.echo else ""
            fmt = _Formatter(parsed, response_id, names[0], self.servicer.token_texts(state), echo)
            events = _events(handle, record)
            if parsed.stream:
                return await _stream(request, events, fmt, parsed)
            return await _collect(events, fmt)
        finally:
            # Runs on normal end, on error and when the client disconnects
            # (the handler task is cancelled): frees the blocks at once.
            record.on_error("CANCELLED", "the client went away")   # no-op once ended
            state.engine.cancel(handle)

    async def _submit(self, state: ServingState, parsed: ParsedRequest, timeout: float | None,
                      key: str | None) -> tuple[RequestHandle, RequestRecord, tuple[int, ...]]:
        """``GenerationServicer.admit`` (the gRPC path's checks, codes and metrics), its
        refusals as OpenAI errors (an invalid field named by its OpenAI argument)."""
        try:
            handle, record, validated = await self.servicer.admit(state, parsed.params, timeout, key)
        except RequestRefused as refused:
            exc = refused.invalid
            if exc is None:
                raise APIError(HTTP_STATUS[refused.code], refused.message) from None
            param = openai_param(exc.field, parsed)
            detail = str(exc).removeprefix(f"{exc.field}: ")
            raise APIError(400, f"{param}: {detail}", param=param) from None
        return handle, record, validated.prompt_token_ids


def _model_not_found(name: str, names: tuple[str, ...]) -> APIError:
    served = ", ".join(f"`{n}`" for n in names)
    return APIError(404, f"The model `{name[:128]}` does not exist: this server serves {served}",
                    param="model", code="model_not_found")


def _timeout(request: web.Request) -> float | None:
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise APIError(400, f"header {TIMEOUT_HEADER}: must be a number of seconds > 0, "
                       f"got {text[:32]!r}", param=TIMEOUT_HEADER)
    return value


def _echo_text(parsed: ParsedRequest, prompt_ids: tuple[int, ...], tokenizer: Any) -> str:
    """The prompt as the completion's echo: its own text, or its token ids decoded."""
    if parsed.params.WhichOneof("prompt") == "text":
        return parsed.params.text
    return str(tokenizer.decode(list(prompt_ids)))


async def _events(handle: RequestHandle, record: RequestRecord) -> AsyncIterator[StreamEvent]:
    """The request's events, recorded; an error event raises APIError."""
    async for event in handle.stream():
        if event.error is not None:
            record.on_error(event.error_code, event.error)
            raise APIError(HTTP_STATUS.get(event.error_code, 500), event.error)
        record.on_tokens(len(event.token_ids))
        if event.stream_done:
            reason = event.finish_reason.value if event.finish_reason is not None else "stop"
            record.on_finish(reason)
        yield event


async def _collect(events: AsyncIterator[StreamEvent], fmt: _Formatter) -> web.Response:
    choices: dict[int, _Choice] = {}
    usage = None
    async for event in events:
        c = choices.setdefault(event.sample_index, _Choice(event.sample_index))
        c.text += event.text
        c.token_ids.extend(event.token_ids)
        c.logprobs.extend(event.logprobs)
        c.top.extend(event.top_logprobs)
        if event.finish_reason is not None:
            c.finish_reason = FINISH_REASONS.get(event.finish_reason, "stop")
        if event.stream_done:
            usage = usage_dict(event)
    body = fmt.full([choices[i] for i in sorted(choices)], usage)
    return web.json_response(body, dumps=_dumps)


async def _stream(request: web.Request, events: AsyncIterator[StreamEvent], fmt: _Formatter,
                  parsed: ParsedRequest) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    choices: dict[int, _Choice] = {}
    try:
        try:
            async for event in events:
                if response is None:    # headers with the first token: errors before keep their status
                    response = web.StreamResponse(headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no"})
                    await response.prepare(request)
                c = choices.setdefault(event.sample_index, _Choice(event.sample_index))
                for chunk in fmt.chunks(c, event):
                    await _send(response, chunk)
                if event.stream_done and parsed.include_usage:
                    await _send(response, fmt.usage_chunk(usage_dict(event)))
        except APIError as exc:
            if response is None:
                return exc.response()
            await _send(response, exc.body())
        if response is None:      # cannot happen: a stream ends with its last event
            raise APIError(500, "the request ended without an answer")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; the caller cancels the request
        pass
    return response if response is not None else web.Response(status=499)


async def _send(response: web.StreamResponse, obj: Mapping[str, Any]) -> None:
    await response.write(f"data: {_dumps(obj)}\n\n".encode())


# Where _authenticate leaves the key's name in a request (aiohttp < 3.12 has no RequestKey).
KEY_NAME: Any = (web.RequestKey("jitney_api_key_name", str) if hasattr(web, "RequestKey")
                 else "jitney_api_key_name")
OPEN_PATHS = frozenset({"/health"})


def _authenticate(keys: ApiKeys, metrics: Metrics) -> Any:
    """A middleware: ``Authorization: Bearer KEY`` or 401 in OpenAI's shape
    (one answer for a missing and a wrong key); the key's name in ``request[KEY_NAME]``."""

    @web.middleware
    async def authenticate(request: web.Request,
                           handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)   # type: ignore[no-any-return]
        sent = request.headers.get("Authorization")
        name = keys.identify(bearer_token(sent))
        if name is None:
            metrics.failure("UNAUTHENTICATED")
            request_log.info("HTTP %s %s from %s: rejected 401 (%s)", request.method, request.path,
                             request.remote, "no key" if sent is None else "a key that matches none")
            error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` "
                             "with a key of this server", code="invalid_api_key")
            return web.json_response(error.body(), status=401, dumps=_dumps,
                                     headers={"WWW-Authenticate": 'Bearer realm="jitney"'})
        request[KEY_NAME] = name
        return await handler(request)   # type: ignore[no-any-return]
    return authenticate


@web.middleware
async def _json_errors(request: web.Request,
                       handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Every error in OpenAI's JSON shape (aiohttp's own 404, 405, 413 too)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, exc.text or exc.reason).response()
    except Exception:
        log.exception("the OpenAI API failed on %s %s", request.method, request.path)
        return APIError(500, "internal error").response()
