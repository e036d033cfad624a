"""The OpenAI API's requests and errors: a chat or completion body as a
``jitney.v1.GenerationParams`` (``parse_request``), and OpenAI's error shape
(``APIError``).

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
    ``null`` is the same as leaving an argument out. ``user`` names the
    request's tenant for ``--fairness tenant`` when no API key does (at most
    256 printable characters).
  * One prompt per completion request (a list of several is refused); chat
    content is a string or text parts (joined with newlines); role
    ``developer`` is ``system``; ``tool`` messages (with ``tool_call_id``) and
    assistant ``tool_calls`` go to the template; legacy ``function`` messages
    and ``functions`` are refused.
  * ``tools`` (function tools), ``tool_choice`` and ``parallel_tool_calls``
    as OpenAI's: calls are parsed in the model family's format and their
    arguments always validate against the tool's schema (a grammar:
    scheduler/api/tools/). ``response_format`` with tools is refused.
  * A model that reasons in ``<think>...</think>`` (its chat template says so,
    or ``--reasoning-parser on``) answers ``reasoning_content`` apart from
    ``content`` (vLLM's field); tool calls and a JSON response format apply
    after the block. ``chat_template_kwargs`` ``enable_thinking`` false (Qwen3):
    nothing is parsed as reasoning.
  * vLLM's extra arguments: ``top_k`` (-1 or 0 = off), ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
    ``stop_token_ids``, ``chat_template_kwargs`` (chat: variables for the
    chat template), and Jitney's ``priority`` and ``cache_salt``.
  * Deadline: the optional ``X-Request-Timeout`` header (seconds), capped by
    ``--max-request-seconds`` as a gRPC deadline is; past it: 504.

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``:
400 invalid request (the message and ``param`` name the OpenAI argument),
401 a missing or unknown API key (``--api-key-file``; every route but
``/health``, key sent as ``Authorization: Bearer KEY``), 404 unknown model or
path, 429 a queue bound (``--max-queued-*``) or the key's
``--max-requests-per-key``, 503 not ready, worker lost or draining, 504
deadline, 500 a worker failure.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jitney.v1 import generation_pb2 as pb
from jitney.scheduler.api.http.encoding import dumps
from jitney.scheduler.api.sampling_defaults import SamplingDefaults
from jitney.scheduler.api.servicer import GenerationServicer, ServingState
from jitney.scheduler.core.fairness import tenant_problem

TIMEOUT_HEADER = "X-Request-Timeout"
COMPLETION_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
UINT32_MAX = 2**32 - 1

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
_CHAT_ARGS = _COMMON_ARGS | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                             "tools", "tool_choice", "parallel_tool_calls"}
_COMPLETION_ARGS = _COMMON_ARGS | {"prompt", "echo", "best_of", "suffix"}

# OpenAI arguments Jitney does not implement: refused unless null or one of
# the values that ask for nothing (the API's own defaults).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ((),), "function_call": ("none",), "audio": (), "modalities": (("text",),), "prediction": (),
    "reasoning_effort": (), "web_search_options": (), "store": (False,), "metadata": (),
    "service_tier": ("auto", "default"), "verbosity": (), "prompt_cache_key": (),
    "prompt_cache_retention": (), "safety_identifier": (),
}

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
               "tool": "tool"}
# Message keys allowed when null or empty (clients echo assistant turns back).
_EMPTY_MESSAGE_KEYS = frozenset({"tool_calls", "tool_call_id", "function_call", "refusal", "audio", "annotations",
                                 "reasoning_content"})


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
        return web.json_response(self.body(), status=self.status, dumps=dumps)


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def serving_state(servicer: GenerationServicer) -> ServingState:
    """The servicer's serving state; APIError 503 while the worker is not
    ready, is lost or the server drains."""
    state, refusing = servicer.state, servicer.refusing
    if state is None or refusing is not None:
        raise APIError(503, refusing or "the worker is not ready yet")
    return state


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
        _chat_template_kwargs(args, p)
        _tools(args, p)
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
    user = _str(args, "user")
    if user:
        if (problem := tenant_problem(user)) is not None:
            raise _bad("user", problem)
        p.tenant = user     # --fairness tenant: the share it uses (an API key's name wins)
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
            if key in ("role", "content", "name") or value is None:
                continue
            if key == "tool_calls" and role == "assistant":
                continue
            if key == "tool_call_id" and role == "tool":
                continue
            if key in _EMPTY_MESSAGE_KEYS and value in ([], ""):
                continue
            raise _bad(f"{where}.{key}", "is not supported by Jitney", code="unsupported_parameter")
        calls = m.get("tool_calls") or []
        content = m.get("content")
        message = p.chat.messages.add(role=_CHAT_ROLES[role],
                                      content="" if content is None and calls else _content(content, where))
        _tool_calls(calls, message, where)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.tool_call_id", "is required in a tool message: a string")
            message.tool_call_id = call_id


def _tool_calls(calls: Any, message: pb.ChatMessage, where: str) -> None:
    """An assistant message's ``tool_calls`` (OpenAI's shape: arguments as JSON text)."""
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", "must be a list of tool calls")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise _bad(at, "must be an object")
        if call.get("type", "function") != "function":
            raise _bad(f"{at}.type", "must be function", code="unsupported_value")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", "is required: an object with name and arguments")
        if not isinstance(call.get("id"), str):
            raise _bad(f"{at}.id", "is required: a string")
        if not isinstance(fn.get("name"), str):
            raise _bad(f"{at}.function.name", "is required: a string")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise _bad(f"{at}.function.arguments", "must be a string of JSON")
        message.tool_calls.add(id=call["id"], name=fn["name"], arguments=arguments)


def _tools(args: Mapping[str, Any], p: pb.GenerationParams) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the proto's fields (their
    rules are checked with the prompt: scheduler/api/tools/spec.py)."""
    tools = args.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise _bad(f"tools[{i}]", "must be an object")
            if tool.get("type") != "function":
                raise _bad(f"tools[{i}].type", f"{str(tool.get('type'))[:32]!r} is not supported by Jitney "
                           "(function tools only)", code="unsupported_value")
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"tools[{i}].function", "is required: an object with a name")
            description = fn.get("description") or ""
            if not isinstance(description, str):
                raise _bad(f"tools[{i}].function.description", "must be a string")
            parameters = fn.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise _bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
            if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
                raise _bad(f"tools[{i}].function.strict", "must be true or false")
            p.tools.add(name=fn["name"], description=description,
                        parameters=json.dumps(parameters) if parameters is not None else "",
                        strict=bool(fn.get("strict")))
    choice = args.get("tool_choice")
    if isinstance(choice, str):
        if choice == "function":
            raise _bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", ...}")
        p.tool_choice = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice", "must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        p.tool_choice, p.tool_choice_function = "function", fn["name"]
    elif choice is not None:
        raise _bad("tool_choice", "must be a string or an object")
    _set(p, "parallel_tool_calls", _bool(args, "parallel_tool_calls"))


def _chat_template_kwargs(args: Mapping[str, Any], p: pb.GenerationParams) -> None:
    """vLLM's ``chat_template_kwargs``, as the JSON text the gRPC door takes too; its keys
    and sizes are checked with the chat (scheduler/api/template_kwargs.py)."""
    value = args.get("chat_template_kwargs")
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("chat_template_kwargs", "must be an object of template variables")
    try:
        p.chat.chat_template_kwargs = json.dumps(value)
    except (ValueError, RecursionError):
        raise _bad("chat_template_kwargs", "is nested too deeply") from None


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
    if rest.startswith(("chat.messages", "chat.chat_template_kwargs")):
        return rest.removeprefix("chat.")
    if rest.startswith("chat"):
        return "messages"
    if rest.startswith("tools["):
        head, _, tail = rest.partition("].")
        return f"{head}].function.{tail}" if tail else head + "]"
    if rest.startswith("tools"):
        return "tools"
    if rest.startswith("tool_choice"):
        return "tool_choice"
    if rest.startswith("response_format.json_schema"):
        return "response_format.json_schema.schema"
    if rest.startswith(("text", "token_ids", "prompt")):
        index = re.search(r"\[\d+\]$", rest)
        return "prompt" + (index.group(0) if index else "")
    return rest.split(".")[0]

