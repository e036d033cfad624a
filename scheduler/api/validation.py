"""Validation of public API requests, with real exceptions.

Every rule raises ``InvalidRequestError`` naming the offending proto field
path (``params.sampling.top_p``); the server maps it to INVALID_ARGUMENT.
Nothing here asserts: a bad request must end as that request's error.

Decisions:
  * Chat message content may be any string, empty included; the message list
    must not be empty and each role must be system, user or assistant.
  * A text prompt is tokenized with the tokenizer's own special-token choice
    (``add_special_tokens=True``: a BOS only where the model wants one).
  * The prompt must be shorter than the context length (room for at least
    one output token). Tokenize requests are not held to the context length.
  * Temperature above ``MAX_TEMPERATURE`` is rejected as a likely mistake.
  * A request id is at most 128 printable ASCII characters (it travels in
    logs and metadata); an empty one is replaced by a uuid4 hex.
  * A cache salt is any string of at most 256 characters; it only names a
    prefix-cache namespace (it is hashed, never logged).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jitney.v1 import generation_pb2
from jitney.scheduler.api.template_kwargs import parse_template_kwargs
from jitney.scheduler.api.tools.formats import (GENERIC, ToolFormat, one_call_per_turn, system_text,
                                                template_message)
from jitney.scheduler.api.tools.spec import ToolRequest, check_tool_turns, tool_request
from jitney.scheduler.core.request import InvalidRequestError, SamplingOptions, ValidatedRequest

# A transformers tokenizer (PreTrainedTokenizerBase).
Tokenizer = Any

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_TEMPERATURE = 100.0
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_PRIORITY = 1000               # |priority| bound; higher boards first
MAX_PENALTY = 2.0                 # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0            # |bias| (OpenAI's range)
MAX_LOGPROBS = 20                 # top_logprobs and prompt_logprobs alternatives
MAX_SAMPLES = 16                  # n
# max_tokens of a constrained request (any response_format) that sets none,
# capped by the room the context leaves. A grammar keeps the output valid but
# cannot make a model end it: a small model inside a long string or an open
# array may go on until the context is full (minutes on a CPU, for an output
# that then ends LENGTH anyway). Structured replies are tens to hundreds of
# tokens; a request that wants more sets max_tokens.
CONSTRAINED_DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class ModelLimits:
    """What the served model and server accept."""

    vocab_size: int                       # token ids must be < this
    context_length: int                   # prompt + output tokens <= this
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024            # entries of logit_bias
    max_prompt_chars: int = 1_000_000     # text, or chat contents summed


def validate_generation(
    params: generation_pb2.GenerationParams,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    *,
    new_seed: Callable[[], int],
    tool_format: ToolFormat = GENERIC,
) -> ValidatedRequest:
    """Check a GenerationParams and resolve its defaults.

    ``new_seed`` draws the seed of a request that sets none; ``tool_format`` is how
    the served model writes tool calls (how its tools and tool turns are rendered).
    Raises InvalidRequestError on the first broken rule.
    """
    request_id = _request_id(params.request_id)
    tools = tool_request(params)
    prompt = render_prompt(params, tokenizer, limits, path="params", tools=tools, tool_format=tool_format)
    _check_prompt_fits(len(prompt), limits, f"params.{params.WhichOneof('prompt')}")
    sampling = _sampling(params.sampling, len(prompt), limits, new_seed,
                         constrained=params.HasField("response_format"))
    return ValidatedRequest(tuple(prompt), sampling, request_id, _priority(params),
                            cache_salt=_cache_salt(params.cache_salt))


def _priority(params: generation_pb2.GenerationParams) -> int:
    p = params.priority if params.HasField("priority") else 0
    if not -MAX_PRIORITY <= p <= MAX_PRIORITY:
        raise InvalidRequestError(
            "params.priority", f"must be in [{-MAX_PRIORITY}, {MAX_PRIORITY}], got {p}")
    return p


def validate_tokenize(
    req: generation_pb2.TokenizeRequest, tokenizer: Tokenizer, limits: ModelLimits
) -> list[int]:
    """Check a TokenizeRequest and return its token ids."""
    return render_prompt(req, tokenizer, limits, path="")


def render_prompt(
    message: generation_pb2.GenerationParams | generation_pb2.TokenizeRequest,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    *,
    path: str,
    tools: ToolRequest | None = None,
    tool_format: ToolFormat = GENERIC,
) -> list[int]:
    """Token ids of the prompt set in ``message`` (its ``prompt`` or
    ``input`` oneof): text tokenized, chat rendered with the chat template,
    token ids checked against the vocabulary.

    ``path`` is the message's own field path ("params", or "" at the top),
    used to name fields in errors.
    """
    prefix = f"{path}." if path else ""
    oneof = "prompt" if isinstance(message, generation_pb2.GenerationParams) else "input"
    kind = message.WhichOneof(oneof)
    if kind == "text":
        ids = _render_text(message.text, tokenizer, limits, f"{prefix}text")
    elif kind == "chat":
        ids = _render_chat(message.chat, tokenizer, limits, f"{prefix}chat", tools, tool_format)
    elif kind == "token_ids" and isinstance(message, generation_pb2.GenerationParams):
        ids = _checked_ids(message.token_ids.ids, limits, f"{prefix}token_ids.ids")
    else:
        raise InvalidRequestError(f"{prefix}{oneof}", "exactly one prompt kind must be set")
    if not ids:
        raise InvalidRequestError(f"{prefix}{kind}", "renders to no tokens")
    return ids


def _render_text(text: str, tokenizer: Tokenizer, limits: ModelLimits, field: str) -> list[int]:
    if not text:
        raise InvalidRequestError(field, "must not be empty")
    if len(text) > limits.max_prompt_chars:
        raise InvalidRequestError(
            field, f"has {len(text)} characters, more than the limit {limits.max_prompt_chars}"
        )
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _render_chat(
    chat: generation_pb2.ChatPrompt, tokenizer: Tokenizer, limits: ModelLimits, field: str,
    tools: ToolRequest | None = None, tool_format: ToolFormat = GENERIC,
) -> list[int]:
    messages = chat.messages
    if not messages:
        raise InvalidRequestError(f"{field}.messages", "must not be empty")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{field}.messages[{i}].role",
                f"must be one of {sorted(CHAT_ROLES)}, got {m.role[:32]!r}",
            )
    check_tool_turns(messages, f"{field}.messages")
    chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)
    if chars > limits.max_prompt_chars:
        raise InvalidRequestError(
            f"{field}.messages",
            f"contents have {chars} characters, more than the limit {limits.max_prompt_chars}",
        )
    variables = parse_template_kwargs(chat.chat_template_kwargs, tokenizer,
                                      f"{field}.chat_template_kwargs")
    return _apply_chat_template(tokenizer, _conversation(messages, tools, tool_format), field, variables,
                                tools.tools if tools is not None and tool_format.in_template else ())


def _conversation(messages: Sequence[generation_pb2.ChatMessage], tools: ToolRequest | None,
                  fmt: ToolFormat) -> list[dict[str, Any]]:
    """The messages as the template reads them; for a template without tool support
    the tools' instructions go first into the system turn (a new one if none)."""
    out = [template_message(m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls],
                            m.tool_call_id, fmt) for m in messages]
    if tools is not None and tools.callable and not fmt.in_template:
        text = system_text(tools.tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text)
        else:
            out.insert(0, {"role": "system", "content": text})
    return one_call_per_turn(out) if fmt.harmony else out


def _apply_chat_template(
    tokenizer: Tokenizer, conversation: list[dict[str, Any]], field: str,
    variables: Mapping[str, Any], tools: Sequence[Any] = (),
) -> list[int]:
    """The chat template with the assistant turn opened, as token ids;
    ``variables`` are the request's extra template variables, ``tools`` passed as
    ``tools=`` (transformers' convention)."""
    from jinja2.exceptions import TemplateError

    extra = dict(variables)
    if tools:
        extra["tools"] = [t.openai() for t in tools]
    try:
        out = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, **extra
        )
    except TemplateError as e:  # the template's own raise_exception(...)
        raise InvalidRequestError(f"{field}.messages", f"rejected by the chat template: {e}") from e
    except (TypeError, ValueError, ArithmeticError, LookupError) as e:
        if not variables:   # the served template's own fault: not the request's
            raise
        # A request's variable of a type the template cannot use (a string where it adds numbers).
        raise InvalidRequestError(f"{field}.chat_template_kwargs",
                                  f"rejected by the chat template: {type(e).__name__}: {str(e)[:120]}") from e
    # transformers 5 returns a BatchEncoding; 4.x a plain list.
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(t) for t in ids]


def _checked_ids(ids: Sequence[int], limits: ModelLimits, field: str) -> list[int]:
    if not ids:
        raise InvalidRequestError(field, "must not be empty")
    _check_prompt_fits(len(ids), limits, field)  # before a long scan
    _check_in_vocab(ids, limits, field)
    return list(ids)


def _check_in_vocab(ids: Sequence[int], limits: ModelLimits, field: str) -> None:
    for i, t in enumerate(ids):
        if t >= limits.vocab_size:
            raise InvalidRequestError(
                f"{field}[{i}]",
                f"token id {t} is outside the vocabulary (size {limits.vocab_size})",
            )


def _check_prompt_fits(num_tokens: int, limits: ModelLimits, field: str) -> None:
    if num_tokens >= limits.context_length:
        raise InvalidRequestError(
            field,
            f"prompt has {num_tokens} tokens, which leaves no room to generate "
            f"within the context length {limits.context_length}",
        )


def _sampling(
    s: generation_pb2.SamplingParams,
    prompt_len: int,
    limits: ModelLimits,
    new_seed: Callable[[], int],
    *,
    constrained: bool = False,
) -> SamplingOptions:
    f = "params.sampling"
    options = SamplingOptions(
        temperature=_temperature(s, f"{f}.temperature"),
        top_p=_top_p(s, f"{f}.top_p"),
        top_k=_top_k(s, limits, f"{f}.top_k"),
        seed=s.seed if s.HasField("seed") else new_seed(),
        max_tokens=_max_tokens(s, prompt_len, limits, f"{f}.max_tokens", constrained),
        stop=_stop_strings(s.stop, limits, f"{f}.stop"),
        stop_token_ids=_stop_token_ids(s.stop_token_ids, limits, f"{f}.stop_token_ids"),
        ignore_eos=s.ignore_eos,
        min_p=_bounded(s, "min_p", 0.0, 0.0, 1.0, f),
        repetition_penalty=_repetition_penalty(s, f"{f}.repetition_penalty"),
        presence_penalty=_bounded(s, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, f),
        frequency_penalty=_bounded(s, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, f),
        logit_bias=_logit_bias(s.logit_bias, limits, f"{f}.logit_bias"),
        min_tokens=_min_tokens(s, f"{f}.min_tokens"),
        top_logprobs=_logprob_count(s, "top_logprobs", f) or 0,
        prompt_logprobs=_logprob_count(s, "prompt_logprobs", f),
        n=_num_samples(s, f"{f}.n"),
    )
    if options.min_tokens > options.max_tokens:
        raise InvalidRequestError(f"{f}.min_tokens", f"must be at most max_tokens ({options.max_tokens}), "
                                                     f"got {options.min_tokens}")
    return options


def _bounded(s: generation_pb2.SamplingParams, name: str, default: float, low: float, high: float,
             path: str) -> float:
    """An optional float field in [low, high] (its default when unset)."""
    if not s.HasField(name):
        return default
    value = getattr(s, name)
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequestError(f"{path}.{name}", f"must be in [{low:g}, {high:g}], got {value:g}")
    return value


def _repetition_penalty(s: generation_pb2.SamplingParams, field: str) -> float:
    if not s.HasField("repetition_penalty"):
        return 1.0
    r = s.repetition_penalty
    if not (math.isfinite(r) and 0 < r <= MAX_REPETITION_PENALTY):
        raise InvalidRequestError(field, f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {r:g}")
    return r


def _logit_bias(bias: Mapping[int, float], limits: ModelLimits, field: str) -> tuple[tuple[int, float], ...]:
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequestError(field, f"has {len(bias)} entries, more than the limit {limits.max_logit_bias}")
    for token, value in bias.items():
        if token >= limits.vocab_size:
            raise InvalidRequestError(f"{field}[{token}]",
                                      f"token id {token} is outside the vocabulary (size {limits.vocab_size})")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(f"{field}[{token}]",
                                      f"bias must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value:g}")
    return tuple(sorted(bias.items()))


def _min_tokens(s: generation_pb2.SamplingParams, field: str) -> int:
    return s.min_tokens if s.HasField("min_tokens") else 0


def _logprob_count(s: generation_pb2.SamplingParams, name: str, path: str) -> int | None:
    """top_logprobs / prompt_logprobs: None when unset, else 0..MAX_LOGPROBS."""
    if not s.HasField(name):
        return None
    value = getattr(s, name)
    if value > MAX_LOGPROBS:
        raise InvalidRequestError(f"{path}.{name}", f"must be at most {MAX_LOGPROBS}, got {value}")
    return value


def _num_samples(s: generation_pb2.SamplingParams, field: str) -> int:
    if not s.HasField("n"):
        return 1
    if not 1 <= s.n <= MAX_SAMPLES:
        raise InvalidRequestError(field, f"must be in [1, {MAX_SAMPLES}], got {s.n}")
    return s.n


def _temperature(s: generation_pb2.SamplingParams, field: str) -> float:
    if not s.HasField("temperature"):
        return 0.0
    t = s.temperature
    if not math.isfinite(t) or t < 0 or t > MAX_TEMPERATURE:
        raise InvalidRequestError(field, f"must be in [0, {MAX_TEMPERATURE:g}], got {t:g}")
    return t


def _top_p(s: generation_pb2.SamplingParams, field: str) -> float:
    if not s.HasField("top_p"):
        return 1.0
    p = s.top_p
    if not (math.isfinite(p) and 0 < p <= 1):
        raise InvalidRequestError(field, f"must be in (0, 1], got {p:g}")
    return p


def _top_k(s: generation_pb2.SamplingParams, limits: ModelLimits, field: str) -> int:
    k = s.top_k
    if k > limits.vocab_size:
        raise InvalidRequestError(
            field, f"must be at most the vocabulary size {limits.vocab_size}, got {k}"
        )
    return k


def _max_tokens(
    s: generation_pb2.SamplingParams, prompt_len: int, limits: ModelLimits, field: str,
    constrained: bool = False,
) -> int:
    room = limits.context_length - prompt_len  # >= 1: the prompt was checked
    if not s.HasField("max_tokens"):
        return min(room, CONSTRAINED_DEFAULT_MAX_TOKENS) if constrained else room
    n = s.max_tokens
    if n < 1:
        raise InvalidRequestError(field, f"must be at least 1, got {n}")
    if n > room:
        raise InvalidRequestError(
            field,
            f"prompt ({prompt_len} tokens) + max_tokens ({n}) exceeds "
            f"the context length {limits.context_length}",
        )
    return n


def _stop_strings(stop: Sequence[str], limits: ModelLimits, field: str) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            field, f"has {len(stop)} strings, more than the limit {limits.max_stop_strings}"
        )
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequestError(f"{field}[{i}]", "must not be empty")
        if len(s) > limits.max_stop_string_chars:
            raise InvalidRequestError(
                f"{field}[{i}]",
                f"has {len(s)} characters, more than the limit {limits.max_stop_string_chars}",
            )
    return tuple(stop)


def _stop_token_ids(ids: Sequence[int], limits: ModelLimits, field: str) -> frozenset[int]:
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            field, f"has {len(ids)} ids, more than the limit {limits.max_stop_token_ids}"
        )
    _check_in_vocab(ids, limits, field)
    return frozenset(ids)


def _request_id(request_id: str) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            "params.request_id",
            f"has {len(request_id)} characters, more than the limit {MAX_REQUEST_ID_CHARS}",
        )
    if not all(" " <= c <= "~" for c in request_id):
        raise InvalidRequestError("params.request_id", "must be printable ASCII")
    return request_id


def _cache_salt(salt: str) -> str:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            "params.cache_salt",
            f"has {len(salt)} characters, more than the limit {MAX_CACHE_SALT_CHARS}",
        )
    return salt
