"""The gRPC face of the scheduler process: jitney.v1.GenerationService.

Handlers validate, submit to the Engine and relay its events. Every error a
client can cause ends as a gRPC status on that call only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import grpc

from jitney.engine.v1 import engine_pb2
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.scheduler.core.admission import QueueFullError
from jitney.scheduler.security.keys import KeyLimiter, KeyLimitError, caller_key
from jitney.scheduler.api.sampling_defaults import SamplingDefaults
from jitney.scheduler.core.detokenizer import TokenTexts
from jitney.scheduler.core.grammar import engine_grammar
from jitney.scheduler.core.engine import Engine, EngineUnavailableError, RequestHandle, StreamEvent
from jitney.scheduler.api.lora_service import LoraCallError, LoraService
from jitney.scheduler.api.metrics import Metrics, RequestRecord, key_field, request_log
from jitney.scheduler.core.fairness import SHARED_TENANT, tenant_problem
from jitney.scheduler.core.request import FinishReason
from jitney.scheduler.api.tools.formats import ToolFormat, format_named, marker_tokens
from jitney.scheduler.api.tools.grammar import reasoned_grammar, tool_grammar
from jitney.scheduler.api.tools.spec import tool_request
from jitney.scheduler.api.tools.stream import OutputParser
from jitney.scheduler.api.validation import ModelLimits, validate_generation, validate_tokenize
from jitney.scheduler.core.request import InvalidRequestError, ValidatedRequest

if TYPE_CHECKING:
    from jitney.scheduler.core.grammar import GrammarCompiler

log = logging.getLogger("jitney.scheduler")

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.END_OF_SEQUENCE: pb.FINISH_REASON_END_OF_SEQUENCE,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
}


@dataclass
class ServingState:
    """What the handlers need once the worker is ready (None before)."""

    engine: Engine
    ready: engine_pb2.Ready
    limits: ModelLimits
    tokenizer: Any


class RequestRefused(Exception):
    """A request the server did not take: a grpc.StatusCode name, the message,
    and the InvalidRequestError when that was the reason."""

    def __init__(self, code: str, message: str, invalid: InvalidRequestError | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.invalid = code, message, invalid


def new_seed() -> int:
    return random.getrandbits(63)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """``key_limits``: requests in flight per API key name, shared by both doors;
    ``api_keys``: whether the doors check keys (metrics then carry a key label);
    ``model_names``: the names both doors answer to, the primary first
    (``--served-model-name``; empty: the worker's ``model_name``);
    ``sampling_defaults``: the generation config's defaults for unset fields;
    ``tool_call_parser``: the tool-call format (``--tool-call-parser``: auto, read
    from the chat template, or a family of scheduler/api/tools/formats.py);
    ``reasoning``: whether output starts with a <think> block that is parsed
    apart (``--reasoning-parser``: auto = when the chat template mentions </think>,
    on, off)."""

    def __init__(self, metrics: Metrics | None = None, *, api_keys: bool = False,
                 key_limits: KeyLimiter | None = None, model_names: Sequence[str] = (),
                 sampling_defaults: SamplingDefaults | None = None, tool_call_parser: str = "auto",
                 reasoning: str = "auto", lora: LoraService | None = None) -> None:
        format_named(tool_call_parser, None)       # a bad name fails at start-up
        if reasoning not in ("auto", "on", "off"):
            raise ValueError(f"--reasoning-parser must be auto, on or off, got {reasoning!r}")
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning
        self.state: ServingState | None = None
        self.model_names = tuple(model_names)
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self._token_texts: TokenTexts | None = None
        self._markers: tuple[Any, ToolFormat, dict[str, int]] | None = None
        # Built at the first constrained request (its tokenizer index takes
        # ~0.5 s), kept across worker restarts of the same vocabulary.
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = asyncio.Lock()
        self.metrics = metrics or Metrics(lambda: self.state.engine if self.state else None,
                                          key_label=api_keys)
        self.key_limits = key_limits or KeyLimiter()
        self.lora = lora or LoraService()     # the served LoRA adapters (lora_service.py)
        # While None: new requests are taken. Else why they get UNAVAILABLE
        # (draining); with no state, the same or "not ready".
        self.refusing: str | None = None

    def served_names(self, state: ServingState) -> tuple[str, ...]:
        """The model's names in the API, the primary first."""
        return self.model_names or (state.ready.model_name,)

    def tool_format(self, state: ServingState) -> ToolFormat:
        """How the served model writes tool calls."""
        return format_named(self.tool_call_parser, getattr(state.tokenizer, "chat_template", None))

    def reasoning_mode(self, state: ServingState, params: pb.GenerationParams,
                       prompt_ids: Sequence[int]) -> str:
        """"on": the output starts inside a reasoning block (the prompt opened one);
        "maybe": it may open one with <think>; "off": no reasoning is parsed (a
        model that does not reason, a text prompt, or the template closed it:
        Qwen3's with enable_thinking false); "harmony": a chat answer of a harmony
        model (gpt-oss), its channels parsed whatever --reasoning-parser says (they are
        the answer's format)."""
        template = getattr(state.tokenizer, "chat_template", None) or ""
        if params.WhichOneof("prompt") == "chat" and self.tool_format(state).harmony:
            return "harmony"
        if self.reasoning == "off" or params.WhichOneof("prompt") != "chat":
            return "off"
        if self.reasoning == "auto" and "</think>" not in template:
            return "off"
        tail = str(state.tokenizer.decode(list(prompt_ids[-24:])))
        opened, closed = tail.rfind("<think>"), tail.rfind("</think>")
        if opened > closed:
            return "on"
        return "off" if closed >= 0 else "maybe"

    def token_texts(self, state: ServingState) -> TokenTexts:
        """Token id -> text, for logprobs (one cache per tokenizer)."""
        if self._token_texts is None or self._token_texts.tokenizer is not state.tokenizer:
            self._token_texts = TokenTexts(state.tokenizer)
        return self._token_texts

    async def _serving(self, context: grpc.aio.ServicerContext) -> ServingState:
        if self.state is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                self.refusing or "the worker is not ready yet")
        assert self.state is not None
        return self.state

    async def _submit(self, params: pb.GenerationParams, context: grpc.aio.ServicerContext
                      ) -> tuple[ServingState, RequestHandle, RequestRecord, ValidatedRequest]:
        state = await self._serving(context)
        try:
            handle, record, validated = await self.admit(state, params, context.time_remaining(),
                                                         caller_key.get())
        except RequestRefused as refused:
            await context.abort(grpc.StatusCode[refused.code], refused.message)
            raise AssertionError("unreachable") from None
        return state, handle, record, validated

    def output_parsers(self, state: ServingState, params: pb.GenerationParams, prompt_ids: Sequence[int],
                       n: int) -> list[OutputParser] | None:
        """One parser per sample where the answer is split (tools with a tool_choice other
        than none, or a reasoning model); None where its text is all content."""
        fmt = self.tool_format(state) if params.tools and params.tool_choice != "none" else None
        reasoning = self.reasoning_mode(state, params, prompt_ids)
        if fmt is None and reasoning == "off":
            return None
        return [OutputParser(fmt, reasoning) for _ in range(n)]

    async def admit(self, state: ServingState, params: pb.GenerationParams, time_remaining: float | None,
                    key: str | None = None, door: str = "grpc", *, token_logprobs: bool = True
                    ) -> tuple[RequestHandle, RequestRecord, ValidatedRequest]:
        """Validate, submit and track one request: the one path of every door
        (gRPC, the OpenAI door). A refusal is counted and logged, then raised
        as ``RequestRefused``; ``time_remaining`` is the caller's deadline,
        ``key`` the name of its API key, ``door`` the API it came through (the
        metrics' ``door`` label). The request holds one of the key's
        slots (``--max-requests-per-key``) until its record ends. ``token_logprobs``:
        the caller reads each sampled token's logprob (gRPC's answers always carry them)."""
        code, message, invalid = "UNAVAILABLE", self.refusing, None
        release = None
        try:
            if message is None:
                release = self.key_limits.acquire(key)
                tenant = request_tenant(params, key)
                validated = replace(await self.validate(state, params), tenant=tenant,
                                    token_logprobs=token_logprobs)
                handle = state.engine.submit(validated, time_remaining)
                record = self.metrics.track(handle.request_id, len(validated.prompt_token_ids),
                                            _prompt_for_log(params) if self.metrics.log_prompts else None,
                                            key, door)
                record.on_end(release)
                release = None
                return handle, record, validated
        except KeyLimitError as exc:
            code, message = "RESOURCE_EXHAUSTED", str(exc)
        except InvalidRequestError as exc:
            code, message, invalid = "INVALID_ARGUMENT", str(exc), exc
        except QueueFullError as exc:
            code, message = "RESOURCE_EXHAUSTED", str(exc)
        except EngineUnavailableError as exc:
            message = str(exc)
        finally:
            if release is not None:     # not admitted: the slot goes back at once
                release()
        self.metrics.failure(code, key, door)
        request_log.info("request %s:%s rejected %s (%s)", params.request_id or "-", key_field(key),
                         code, message)
        raise RequestRefused(code, message, invalid)

    async def validate(self, state: ServingState, params: pb.GenerationParams) -> ValidatedRequest:
        """Every rule of ``validate_generation``, then the response format's
        grammar compiled (off the loop, bounded in time). Raises
        InvalidRequestError, or QueueFullError when the compiler is saturated."""
        defaults = self.sampling_defaults
        if defaults.needs_fill(params.sampling):     # a copy: the caller's message stays as sent
            filled = pb.GenerationParams()
            filled.CopyFrom(params)
            defaults.fill(filled.sampling, state.limits.vocab_size)
            params = filled
        fmt = self.tool_format(state)
        validated = validate_generation(params, state.tokenizer, state.limits, new_seed=new_seed,
                                        tool_format=fmt)
        if params.lora_adapter:
            validated = replace(validated, lora=self.lora.resolve(params.lora_adapter))
        max_tokens = defaults.max_tokens_for(params.sampling, validated.sampling.max_tokens,
                                             validated.sampling.min_tokens)
        if max_tokens != validated.sampling.max_tokens:
            validated = replace(validated, sampling=replace(validated.sampling, max_tokens=max_tokens))
        tools = tool_request(params)
        calls = tools is not None and bool(tools.callable)
        if not calls and not params.HasField("response_format") and not fmt.harmony:
            return validated
        reasoning = self.reasoning_mode(state, params, validated.prompt_token_ids)
        tokens = self._marker_tokens(state, fmt)
        if tokens and (reasoning == "harmony" or calls):
            # The markers are special tokens, which the detokenizer would drop: the parser reads them.
            validated = replace(validated, keep_special=frozenset(tokens.values()))
        if tools is not None and calls:
            if params.HasField("response_format"):
                raise InvalidRequestError("params.response_format",
                                          "together with tools is not supported (set tool_choice none)")
            compiler = await self._grammar_compiler(state)
            grammar = await compiler.compile_lark(tool_grammar(fmt, tools, reasoning, tokens), "params.tools")
            return replace(validated, grammar=grammar)
        if not params.HasField("response_format"):
            return validated
        compiler = await self._grammar_compiler(state)
        if reasoning != "off":
            # The format applies to the answer after the reasoning block (harmony: the final channel).
            answer, field = engine_grammar(params.response_format)
            text = reasoned_grammar(answer, reasoning, tokens)
            return replace(validated, grammar=await compiler.compile_toplevel(text, field))
        return replace(validated, grammar=await compiler.compile(params.response_format))

    def _marker_tokens(self, state: ServingState, fmt: ToolFormat) -> dict[str, int]:
        """``marker_tokens`` of the served tokenizer, computed once per tokenizer and format."""
        cached = self._markers
        if cached is None or cached[0] is not state.tokenizer or cached[1] is not fmt:
            cached = self._markers = (state.tokenizer, fmt, marker_tokens(fmt, state.tokenizer))
        return cached[2]

    async def _grammar_compiler(self, state: ServingState) -> GrammarCompiler:
        async with self._grammars_lock:
            vocab, eos = state.ready.vocab_size, sorted(state.ready.eos_token_ids)
            current = self._grammars
            if current is None or (current.vocab_size, sorted(current.eos_token_ids)) != (vocab, eos):
                from jitney.scheduler.core.grammar import GrammarCompiler

                self._grammars = await asyncio.to_thread(GrammarCompiler, state.tokenizer, vocab,
                                                         eos_token_ids=eos)
            assert self._grammars is not None
            return self._grammars

    async def GenerateStream(self, request: pb.GenerateStreamRequest,
                             context: grpc.aio.ServicerContext):  # type: ignore[override]
        state, handle, record, validated = await self._submit(request.params, context)
        texts = self.token_texts(state)
        sampled_texts = request.params.sampling.HasField("top_logprobs")
        parsers = self.output_parsers(state, request.params, validated.prompt_token_ids, len(handle.samples))
        try:
            async for event in handle.stream():
                await _record(record, event, context)
                response = _stream_response(handle.request_id, event, texts, sampled_texts)
                _split_stream(response, event, parsers)
                yield response
        finally:
            # Runs on normal end, on error and when the client cancels or
            # disconnects (the handler task is cancelled): frees the blocks.
            record.on_error("CANCELLED", "the client went away")   # no-op once ended
            state.engine.cancel(handle)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        state, handle, record, validated = await self._submit(request.params, context)
        texts = self.token_texts(state)
        sampled_texts = request.params.sampling.HasField("top_logprobs")
        parsers = self.output_parsers(state, request.params, validated.prompt_token_ids, len(handle.samples))
        response = pb.GenerateResponse(request_id=handle.request_id)
        samples = [pb.GeneratedSample(index=i) for i in range(len(handle.samples))]
        try:
            async for event in handle.stream():
                await _record(record, event, context)
                sample = samples[event.sample_index]
                sample.text += event.text
                sample.token_ids.extend(event.token_ids)
                sample.logprobs.extend(event.logprobs)
                sample.top_logprobs.extend(_top_logprobs(event, texts))
                if sampled_texts:
                    sample.tokens.extend(texts.many(event.token_ids))
                if event.prompt_logprobs is not None:
                    response.prompt_logprobs.extend(_prompt_logprobs(event, texts))
                if event.finish_reason is not None:
                    sample.finish_reason = FINISH_REASONS[event.finish_reason]
                if event.stream_done:
                    response.usage.CopyFrom(_usage(event))
        finally:
            record.on_error("CANCELLED", "the client went away")   # no-op once ended
            state.engine.cancel(handle)
        for sample in samples:
            _split_whole(sample, parsers[sample.index] if parsers else None)
        first = samples[0]
        response.text, response.finish_reason = first.text, first.finish_reason
        response.content, response.reasoning_content = first.content, first.reasoning_content
        response.tool_calls.extend(first.tool_calls)
        response.token_ids.extend(first.token_ids)
        response.logprobs.extend(first.logprobs)
        response.top_logprobs.extend(first.top_logprobs)
        response.tokens.extend(first.tokens)
        if len(samples) > 1:
            response.samples.extend(samples)
        return response

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        state = await self._serving(context)
        try:
            ids = validate_tokenize(request, state.tokenizer, state.limits)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tokens = [state.tokenizer.decode([i]) for i in ids]
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        state = await self._serving(context)
        ready, cfg = state.ready, state.engine.config
        return pb.GetModelInfoResponse(
            model_name=self.served_names(state)[0],
            context_length=state.limits.context_length,
            vocab_size=ready.vocab_size,
            eos_token_ids=list(ready.eos_token_ids),
            num_kv_blocks=ready.num_blocks,
            block_size=ready.block_size,
            dtype=ready.dtype,
            device=ready.device,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            warmup_seconds=ready.warmup_seconds,
            batch_invariant=ready.batch_invariant,
            quantization=ready.quantization or "none",
            model_implementation=implementation(ready),
            batch_invariance_guaranteed=invariance_guaranteed(ready),
            lora_adapters=[pb.LoraAdapterInfo(name=a.name, path=a.path, rank=a.spec.rank)
                           for a in self.lora.registry.adapters()],
            max_loras=ready.max_loras,
        )

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoadLoraAdapterResponse:
        await self._serving(context)
        try:
            adapter = self.lora.load(request.lora_name, request.lora_path)
        except LoraCallError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
            raise AssertionError("unreachable") from None
        return pb.LoadLoraAdapterResponse(rank=adapter.spec.rank, target_modules=adapter.spec.targets)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.UnloadLoraAdapterResponse:
        try:
            self.lora.unload(request.lora_name)
        except LoraCallError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        return pb.UnloadLoraAdapterResponse()

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetServerStatsResponse:
        engine = (await self._serving(context)).engine
        sched = engine.scheduler
        return pb.GetServerStatsResponse(
            requests_running=sched.num_running,
            requests_waiting=sched.num_waiting,
            kv_blocks_total=sched.block_manager.num_blocks,   # the pool: a null block is not one
            kv_blocks_used=sched.block_manager.num_used_blocks,
            steps=engine.num_steps,
            preemptions=engine.num_preemptions,
            prefix_cache_queried_tokens=sched.block_manager.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=sched.block_manager.prefix_cache_hit_tokens,
            worker_pid=self.state.ready.worker_pid if self.state else 0,
            worker_restarts=self.metrics.state.worker_restarts,
            grammar_masked_steps=engine.num_masked_steps,
            grammar_mask_seconds=engine.mask_seconds,
            grammar_forced_tokens=engine.num_forced_tokens,
            spec_decode_num_drafts=sched.num_drafts,
            spec_decode_num_draft_tokens=sched.num_draft_tokens,
            spec_decode_num_accepted_tokens=sched.num_accepted_tokens,
        )


async def _record(record: RequestRecord, event: StreamEvent,
                  context: grpc.aio.ServicerContext) -> None:
    """Feed ``event`` to the request's record; abort the call on an error event."""
    if event.error is not None:
        record.on_error(event.error_code, event.error)
        await context.abort(grpc.StatusCode[event.error_code], event.error)
    record.on_tokens(len(event.token_ids))
    if event.stream_done:
        assert event.finish_reason is not None
        record.on_finish(event.finish_reason.value)


def _split_stream(response: pb.GenerateStreamResponse, event: StreamEvent,
                  parsers: list[OutputParser] | None) -> None:
    """A stream message's content / reasoning / tool-call deltas (content = text without parsers)."""
    if parsers is None:
        response.content = event.text
        return
    parser = parsers[event.sample_index]
    deltas = parser.feed(event.text)
    if event.finish_reason is not None:
        rest = parser.finish()
        deltas.content += rest.content
        deltas.reasoning += rest.reasoning
    response.content, response.reasoning_content = deltas.content, deltas.reasoning
    for d in deltas.calls:
        response.tool_call_deltas.add(index=d.index, id=d.id, name=d.name, arguments=d.arguments)


def _split_whole(sample: pb.GeneratedSample, parser: OutputParser | None) -> None:
    if parser is None:
        sample.content = sample.text
        return
    parser.feed(sample.text)
    parser.finish()
    sample.content = parser.content.strip() if parser.calls else parser.content
    sample.reasoning_content = parser.reasoning
    for call in parser.calls:
        sample.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)


def request_tenant(params: pb.GenerationParams, key: str | None) -> str:
    """Whose share a request uses (``--fairness tenant``): its API key's name,
    else its ``tenant`` field (the OpenAI doors' ``user``), else the shared
    tenant. Raises InvalidRequestError for a tenant field out of bounds."""
    if (problem := tenant_problem(params.tenant)) is not None:
        raise InvalidRequestError("params.tenant", problem)
    if key is not None:
        return key
    return params.tenant or SHARED_TENANT


def _prompt_for_log(params: pb.GenerationParams) -> object:
    kind = params.WhichOneof("prompt")
    if kind == "text":
        return params.text
    if kind == "token_ids":
        return list(params.token_ids.ids)
    return [(m.role, m.content) for m in params.chat.messages]


def _usage(event: StreamEvent) -> pb.Usage:
    return pb.Usage(prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    cached_prompt_tokens=event.cached_prompt_tokens)


def _top(top: list[tuple[int, float]], texts: TokenTexts) -> pb.TopLogprobs:
    ids = [t for t, _ in top]
    return pb.TopLogprobs(token_ids=ids, logprobs=[lp for _, lp in top], tokens=texts.many(ids))


def _top_logprobs(event: StreamEvent, texts: TokenTexts) -> list[pb.TopLogprobs]:
    return [_top(top, texts) for top in event.top_logprobs]


def _prompt_logprobs(event: StreamEvent, texts: TokenTexts) -> list[pb.PromptTokenLogprob]:
    assert event.prompt_logprobs is not None
    out = []
    for token, logprob, top in event.prompt_logprobs:
        entry = pb.PromptTokenLogprob(token_id=token, token=texts(token), top=_top(top, texts))
        if logprob is not None:
            entry.logprob = logprob
        out.append(entry)
    return out


def _stream_response(request_id: str, event: StreamEvent, texts: TokenTexts,
                     sampled_texts: bool) -> pb.GenerateStreamResponse:
    """One stream message; ``sampled_texts``: with the sampled tokens' texts."""
    response = pb.GenerateStreamResponse(
        request_id=request_id, token_ids=event.token_ids, logprobs=event.logprobs, text=event.text,
        sample_index=event.sample_index, top_logprobs=_top_logprobs(event, texts),
        tokens=texts.many(event.token_ids) if sampled_texts else [])
    if event.prompt_logprobs is not None:
        response.prompt_logprobs.extend(_prompt_logprobs(event, texts))
    if event.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[event.finish_reason]
    if event.stream_done:
        response.usage.CopyFrom(_usage(event))
    return response


def implementation(ready: engine_pb2.Ready) -> str:
    """Which code runs the worker's model: "native" or "transformers" (a worker older
    than the field runs only native families)."""
    return ready.model_implementation or "native"


def invariance_guaranteed(ready: engine_pb2.Ready) -> bool:
    """Whether the worker guarantees batch invariance (an older worker: when its
    invariant kernels run, as all its models were native)."""
    return ready.batch_invariance_guaranteed if ready.model_implementation else ready.batch_invariant
