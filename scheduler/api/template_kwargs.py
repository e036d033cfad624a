"""A chat request's ``chat_template_kwargs``: extra variables for the chat
template (``{"enable_thinking": false}`` for Qwen3's), checked before they
reach ``apply_chat_template``.

Both doors carry them as the text of a JSON object (``ChatPrompt.
chat_template_kwargs``; the OpenAI door serialises its object into it), so
one check serves both and integers stay integers.

Decisions:
  * Keys are identifiers: a template can read no other name.
  * A key the chat path or transformers already sets is refused, not
    overridden: ``apply_chat_template``'s own parameters (``tokenize``,
    ``chat_template``, ``tools``, ... would change what the call does, not
    what the template sees), the names its renderer passes (``messages``,
    ``add_generation_prompt``), the special tokens it passes (``bos_token``,
    ...) and the globals it defines (``raise_exception``, ...).
  * Bounds: at most ``MAX_KEYS`` keys of ``MAX_KEY_CHARS``, each value's JSON
    at most ``MAX_VALUE_CHARS``; the whole text is bounded before it is parsed.
"""

from __future__ import annotations

import inspect
import json
import re
from functools import cache
from typing import Any

from jitney.scheduler.core.request import InvalidRequestError

MAX_KEYS = 32
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 4096
MAX_TEXT_CHARS = MAX_KEYS * (MAX_KEY_CHARS + MAX_VALUE_CHARS + 8)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What transformers' renderer passes or defines besides apply_chat_template's
# parameters (transformers.utils.chat_template_utils.render_jinja_template).
_RENDERER_NAMES = frozenset({
    "messages", "add_generation_prompt", "tools", "documents",
    "raise_exception", "strftime_now", "dict", "namespace",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
})


@cache
def _apply_parameters() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in params.items()
                     if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD)


def reserved_names(tokenizer: Any) -> frozenset[str]:
    """The keys a request may not set: see the module docstring."""
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    return _apply_parameters() | _RENDERER_NAMES | frozenset(special)


def parse_template_kwargs(text: str, tokenizer: Any, field: str) -> dict[str, Any]:
    """The variables of ``text`` (a JSON object; "" is none); raises
    InvalidRequestError naming ``field`` (or ``field.KEY``)."""
    if not text:
        return {}
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidRequestError(field, f"has {len(text)} characters, more than the limit {MAX_TEXT_CHARS}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(field, f"must be a JSON object: {str(exc)[:80]}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be a JSON object, got {type(value).__name__}")
    if len(value) > MAX_KEYS:
        raise InvalidRequestError(field, f"has {len(value)} keys, more than the limit {MAX_KEYS}")
    reserved = reserved_names(tokenizer)
    for key, item in value.items():
        _check_key(key, reserved, field)
        size = len(json.dumps(item))
        if size > MAX_VALUE_CHARS:
            raise InvalidRequestError(f"{field}.{key}", f"value has {size} characters of JSON, "
                                      f"more than the limit {MAX_VALUE_CHARS}")
    return value


def _check_key(key: str, reserved: frozenset[str], field: str) -> None:
    if len(key) > MAX_KEY_CHARS or not _IDENTIFIER.fullmatch(key):
        raise InvalidRequestError(field, f"key {key[:32]!r} is not an identifier of at most "
                                  f"{MAX_KEY_CHARS} characters (letters, digits, _)")
    if key in reserved:
        raise InvalidRequestError(f"{field}.{key}", "is set by the server's chat path itself "
                                  "and cannot be given as a template variable")
