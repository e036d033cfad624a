"""A small typed Python client for jitney.v1.GenerationService."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import grpc

from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.client.channel import TlsFiles, open_channel

FINISH_REASON_NAMES = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_END_OF_SEQUENCE: "end_of_sequence",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_CONTEXT_LENGTH: "context_length",
}


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; None means the server default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int | None = None

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "min_tokens", "top_logprobs", "prompt_logprobs", "n")

    def to_proto(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                                ignore_eos=self.ignore_eos, logit_bias=dict(self.logit_bias))
        for name in self._OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        return msg


def response_format(*, json_schema: str | None = None, json_object: bool = False, regex: str | None = None,
                    choices: Sequence[str] = (), grammar: str | None = None) -> pb.ResponseFormat | None:
    """A ResponseFormat from at most one kind of constraint (None: free text)."""
    kinds = [json_schema is not None, json_object, regex is not None, bool(choices), grammar is not None]
    if sum(kinds) > 1:
        raise ValueError("give at most one of json_schema, json_object, regex, choices, grammar")
    if json_schema is not None:
        return pb.ResponseFormat(json_schema=json_schema)
    if json_object:
        return pb.ResponseFormat(json_object=True)
    if regex is not None:
        return pb.ResponseFormat(regex=regex)
    if choices:
        return pb.ResponseFormat(choice=pb.Choice(choices=list(choices)))
    if grammar is not None:
        return pb.ResponseFormat(grammar=grammar)
    return None


def make_params(prompt: str | Sequence[int] | Sequence[tuple[str, str]], *, chat: bool = False,
                sampling: Sampling = Sampling(), request_id: str = "",
                constraint: pb.ResponseFormat | None = None) -> pb.GenerationParams:
    """Build GenerationParams from text, token ids, or (role, content) pairs.

    With ``chat=True`` a text prompt becomes one user message. ``constraint``
    (see ``response_format``) makes the output structured.
    """
    params = pb.GenerationParams(sampling=sampling.to_proto(), request_id=request_id)
    if constraint is not None:
        params.response_format.CopyFrom(constraint)
    if isinstance(prompt, str) and chat:
        params.chat.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        params.text = prompt
    elif prompt and isinstance(prompt[0], tuple):
        for role, content in prompt:  # type: ignore[misc]
            params.chat.messages.add(role=role, content=content)
    else:
        params.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return params


class JitneyClient:
    """Blocking client over one gRPC channel: plaintext, or TLS with ``tls``;
    ``api_key`` goes with every call (``authorization: Bearer KEY``)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, tls: TlsFiles | None = None,
                 api_key: str | None = None) -> None:
        self.channel = open_channel(target, tls=tls, api_key=api_key)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def generate_stream(self, params: pb.GenerationParams,
                        timeout: float | None = None) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(pb.GenerateStreamRequest(params=params), timeout=timeout)

    def generate(self, params: pb.GenerationParams, timeout: float | None = None) -> pb.GenerateResponse:
        return self.stub.Generate(pb.GenerateRequest(params=params), timeout=timeout)

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    def server_stats(self, timeout: float | None = None) -> pb.GetServerStatsResponse:
        return self.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=timeout)

    def wait_ready(self, timeout: float) -> None:
        """Block until the channel connects (not until the worker is ready)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "JitneyClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

