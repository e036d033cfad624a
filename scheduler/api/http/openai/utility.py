"""The small endpoints clients of vLLM's server expect, in its shapes:

    POST /tokenize      {"prompt": text} or {"messages": [...]}  ->
                        {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize    {"tokens": [ids]}                        -> {"prompt": text}
    GET  /version                                                -> {"version": "..."}

A prompt is tokenized as a completion's (special tokens added); messages are
rendered as a chat completion's (the chat template with the assistant's turn
opened), by the same ``validate_tokenize`` as the gRPC door's Tokenize. ``model``
is optional: a served name or a loaded LoRA adapter's (an adapter has its base
model's tokenizer), else 404 ``model_not_found`` as on the other routes. Errors
are the OpenAI door's (``APIError``), naming the argument.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.openai.lora_routes import model_adapter
from jitney.scheduler.api.http.openai.protocol import APIError, parse_request, serving_state
from jitney.scheduler.api.servicer import GenerationServicer
from jitney.scheduler.api.validation import validate_tokenize
from jitney.scheduler.core.request import InvalidRequestError
from jitney.v1 import generation_pb2 as pb

_TOKENIZE_ARGS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "return_token_strs", "chat_template_kwargs"}
_DETOKENIZE_ARGS = {"model", "tokens"}


class UtilityRoutes:
    """/tokenize, /detokenize and /version over ``servicer``'s serving state."""

    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)
        router.add_get("/version", self.version)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version("jitney")})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _body(request, _TOKENIZE_ARGS)
        state = serving_state(self.servicer)
        self._check_model(body)
        tokenize = pb.TokenizeRequest()
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if has_prompt:
            for key in ("add_generation_prompt", "chat_template_kwargs"):
                if key in body:
                    raise APIError(400, f"{key}: is only allowed with messages", param=key)
            if not isinstance(body["prompt"], str):
                raise APIError(400, "prompt: must be a string", param="prompt")
            if _flag(body, "add_special_tokens", True) is not True:
                raise APIError(400, "add_special_tokens: only true is supported for a prompt (it is "
                               "tokenized as a completion's)", param="add_special_tokens",
                               code="unsupported_value")
            tokenize.text = body["prompt"]
        else:
            if _flag(body, "add_generation_prompt", True) is not True:
                raise APIError(400, "add_generation_prompt: only true is supported (messages are "
                               "rendered as a chat completion's)", param="add_generation_prompt",
                               code="unsupported_value")
            if _flag(body, "add_special_tokens", False) is not False:
                raise APIError(400, "add_special_tokens: only false is supported for messages (the "
                               "chat template adds them)", param="add_special_tokens",
                               code="unsupported_value")
            chat = {k: body[k] for k in ("messages", "chat_template_kwargs") if k in body}
            parsed = parse_request(chat, chat=True)
            tokenize.chat.CopyFrom(parsed.params.chat)
        want_strs = _flag(body, "return_token_strs", False)
        try:
            ids = validate_tokenize(tokenize, state.tokenizer, state.limits)
        except InvalidRequestError as exc:
            param = _openai_name(exc.field)
            raise APIError(400, f"{param}: {str(exc).removeprefix(f'{exc.field}: ')}", param=param) from None
        strs = list(state.tokenizer.convert_ids_to_tokens(ids)) if want_strs else None
        return web.json_response({"count": len(ids), "max_model_len": state.limits.context_length,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _body(request, _DETOKENIZE_ARGS)
        state = serving_state(self.servicer)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise APIError(400, "tokens: is required: a list of token ids", param="tokens")
        for i, t in enumerate(tokens):
            if type(t) is not int or not 0 <= t < state.limits.vocab_size:
                raise APIError(400, f"tokens[{i}]: {str(t)[:32]} is not a token id of this model "
                               f"(0 to {state.limits.vocab_size - 1})", param=f"tokens[{i}]")
        return web.json_response({"prompt": str(state.tokenizer.decode(tokens))})

    def _check_model(self, body: dict[str, Any]) -> None:
        """A served name or a loaded adapter's (whose tokenizer is the base model's)."""
        model_adapter(self.servicer, serving_state(self.servicer), body.get("model"))


async def _body(request: web.Request, allowed: set[str]) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key in body:
        if key not in allowed:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key,
                           code="unknown_parameter")
    return body


def _openai_name(field: str) -> str:
    """The argument a TokenizeRequest field was built from."""
    if field == "text":
        return "prompt"
    return field.removeprefix("chat.") if field.startswith("chat.") else field


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{key}: must be a boolean", param=key)
    return value
