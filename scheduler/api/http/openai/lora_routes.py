"""The OpenAI door's LoRA routes, in vLLM's shapes, over the servicer's
adapters (scheduler/api/lora_service.py, shared with gRPC):

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"}: 200 text; 400
                                   a bad adapter or name (param names the
                                   field), 409 a name already loaded
    POST /v1/unload_lora_adapter   {"lora_name"}: 200 text; 404 unknown

and how a request's ``model`` selects an adapter (``select_model``; ``model_adapter``
for the routes that only check the name). Both
routes sit behind the API key like every route but /health (middleware.py).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from jitney.scheduler.api.http.openai.protocol import APIError, serving_state
from jitney.scheduler.api.lora_service import LoraCallError
from jitney.scheduler.api.servicer import GenerationServicer, ServingState
from jitney.v1 import generation_pb2 as pb

_HTTP = {"INVALID_ARGUMENT": 400, "ALREADY_EXISTS": 409, "NOT_FOUND": 404, "UNAVAILABLE": 503}
_CODES = {409: "lora_adapter_exists", 404: "lora_adapter_not_found"}


def select_model(servicer: GenerationServicer, state: ServingState, model: Any, params: pb.GenerationParams) -> None:
    """Check a request's ``model``: a served name (the base model), or an
    adapter's, which ``params`` then runs with. Else 404 ``model_not_found``."""
    if adapter := model_adapter(servicer, state, model):
        params.lora_adapter = adapter


def model_adapter(servicer: GenerationServicer, state: ServingState, model: Any) -> str:
    """The adapter a request's ``model`` names ("": none given, or a served name
    of the base model); 404 ``model_not_found`` for any other name."""
    if model is None:
        return ""
    names = servicer.served_names(state)
    if model in names:
        return ""
    if isinstance(model, str) and servicer.lora.registry.get(model) is not None:
        return model
    served = ", ".join(f"`{n}`" for n in (*names, *servicer.lora.registry.names()))
    raise APIError(404, f"The model `{str(model)[:128]}` does not exist: this server serves {served}",
                   param="model", code="model_not_found")


class LoraRoutes:
    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/load_lora_adapter", self.load)
        router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        serving_state(self.servicer)
        body = await _body(request, ("lora_name", "lora_path"))
        try:
            adapter = self.servicer.lora.load(body.get("lora_name", ""), body.get("lora_path", ""))
        except LoraCallError as exc:
            raise _error(exc) from None
        return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await _body(request, ("lora_name", "lora_int_id"))
        try:
            adapter = self.servicer.lora.unload(body.get("lora_name", ""))
        except LoraCallError as exc:
            raise _error(exc) from None
        return web.Response(text=f"Success: LoRA adapter '{adapter.name}' removed successfully.")


async def _body(request: web.Request, fields: tuple[str, ...]) -> dict[str, str]:
    """The JSON object of the request, its fields strings (``fields`` only)."""
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in fields:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)
        if key != "lora_int_id" and not isinstance(value, str):
            raise APIError(400, f"{key}: must be a string", param=key)
    return {k: v for k, v in body.items() if k != "lora_int_id"}


def _error(exc: LoraCallError) -> APIError:
    status = _HTTP.get(exc.code, 500)
    return APIError(status, f"{exc.field}: {exc.message}", param=exc.field, code=_CODES.get(status))
