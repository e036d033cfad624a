"""Request validation: one test per rule, valid requests' token ids, and a
property test that random requests either pass within every limit or fail
with InvalidRequestError."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jitney.v1 import generation_pb2 as pb
from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
from jitney.scheduler.api.validation import ModelLimits, validate_generation, validate_tokenize
from jitney.scheduler.core.request import InvalidRequestError, ValidatedRequest

VOCAB = 49152
LIMITS = ModelLimits(vocab_size=VOCAB, context_length=64, max_prompt_chars=1000)
SEED = 1234


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_model(None), cache_root())


def validate(tok: Any, params: pb.GenerationParams, limits: ModelLimits = LIMITS) -> ValidatedRequest:
    return validate_generation(params, tok, limits, new_seed=lambda: SEED)


def chat(*turns: tuple[str, str]) -> pb.ChatPrompt:
    return pb.ChatPrompt(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


def sampling(**kw: Any) -> dict[str, Any]:
    return {"text": "Hello", "sampling": pb.SamplingParams(**kw)}


# ---- one test per error --------------------------------------------------

ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "no prompt": ({}, "params.prompt"),
    "empty text": ({"text": ""}, "params.text"),
    "text too many chars": ({"text": "a" * 1001}, "params.text"),
    "text too many tokens": ({"text": " word" * 64}, "params.text"),
    "empty token ids": ({"token_ids": pb.TokenIds(ids=[])}, "params.token_ids.ids"),
    "token id outside vocab": ({"token_ids": pb.TokenIds(ids=[1, 2, 3, 50000])}, "params.token_ids.ids[3]"),
    "token ids fill the context": ({"token_ids": pb.TokenIds(ids=[5] * 64)}, "params.token_ids.ids"),
    "empty chat": ({"chat": pb.ChatPrompt()}, "params.chat.messages"),
    "unknown role": ({"chat": chat(("system", "s"), ("user", "u"), ("robot", "r"))}, "params.chat.messages[2].role"),
    "empty role": ({"chat": chat(("", "u"))}, "params.chat.messages[0].role"),
    "chat too many chars": ({"chat": chat(("user", "a" * 600), ("user", "b" * 401))}, "params.chat.messages"),
    "chat too many tokens": ({"chat": chat(("user", " word" * 60))}, "params.chat"),
    "temperature negative": (sampling(temperature=-0.5), "params.sampling.temperature"),
    "temperature nan": (sampling(temperature=math.nan), "params.sampling.temperature"),
    "temperature inf": (sampling(temperature=math.inf), "params.sampling.temperature"),
    "temperature absurd": (sampling(temperature=101), "params.sampling.temperature"),
    "top_p zero": (sampling(top_p=0), "params.sampling.top_p"),
    "top_p negative": (sampling(top_p=-0.1), "params.sampling.top_p"),
    "top_p above one": (sampling(top_p=1.5), "params.sampling.top_p"),
    "top_p nan": (sampling(top_p=math.nan), "params.sampling.top_p"),
    "top_p inf": (sampling(top_p=math.inf), "params.sampling.top_p"),
    "top_k above vocab": (sampling(top_k=VOCAB + 1), "params.sampling.top_k"),
    "max_tokens zero": (sampling(max_tokens=0), "params.sampling.max_tokens"),
    "max_tokens past context": (sampling(max_tokens=64), "params.sampling.max_tokens"),
    "too many stops": (sampling(stop=[f"s{i}" for i in range(17)]), "params.sampling.stop"),
    "empty stop": (sampling(stop=["ok", ""]), "params.sampling.stop[1]"),
    "stop too long": (sampling(stop=["x" * 257]), "params.sampling.stop[0]"),
    "stop token outside vocab": (sampling(stop_token_ids=[2, VOCAB]), "params.sampling.stop_token_ids[1]"),
    "too many stop tokens": (sampling(stop_token_ids=[2] * 1025), "params.sampling.stop_token_ids"),
    "min_p negative": (sampling(min_p=-0.1), "params.sampling.min_p"),
    "min_p above one": (sampling(min_p=1.5), "params.sampling.min_p"),
    "min_p nan": (sampling(min_p=math.nan), "params.sampling.min_p"),
    "repetition_penalty zero": (sampling(repetition_penalty=0), "params.sampling.repetition_penalty"),
    "repetition_penalty huge": (sampling(repetition_penalty=11), "params.sampling.repetition_penalty"),
    "repetition_penalty inf": (sampling(repetition_penalty=math.inf), "params.sampling.repetition_penalty"),
    "presence_penalty out of range": (sampling(presence_penalty=2.5), "params.sampling.presence_penalty"),
    "frequency_penalty out of range": (sampling(frequency_penalty=-2.5), "params.sampling.frequency_penalty"),
    "frequency_penalty nan": (sampling(frequency_penalty=math.nan), "params.sampling.frequency_penalty"),
    "logit_bias token outside vocab": (sampling(logit_bias={VOCAB: 1.0}), f"params.sampling.logit_bias[{VOCAB}]"),
    "logit_bias too large": (sampling(logit_bias={5: 101.0}), "params.sampling.logit_bias[5]"),
    "logit_bias nan": (sampling(logit_bias={5: math.nan}), "params.sampling.logit_bias[5]"),
    "logit_bias too many": (sampling(logit_bias={i: 1.0 for i in range(1025)}), "params.sampling.logit_bias"),
    "min_tokens above max_tokens": (sampling(min_tokens=5, max_tokens=4), "params.sampling.min_tokens"),
    "top_logprobs above 20": (sampling(top_logprobs=21), "params.sampling.top_logprobs"),
    "prompt_logprobs above 20": (sampling(prompt_logprobs=21), "params.sampling.prompt_logprobs"),
    "n zero": (sampling(n=0), "params.sampling.n"),
    "n above 16": (sampling(n=17), "params.sampling.n"),
    "request id too long": ({"text": "hi", "request_id": "r" * 129}, "params.request_id"),
    "request id control char": ({"text": "hi", "request_id": "a\nb"}, "params.request_id"),
    "request id not ascii": ({"text": "hi", "request_id": "réq"}, "params.request_id"),
    "cache salt too long": ({"text": "hi", "cache_salt": "s" * 257}, "params.cache_salt"),
}


@pytest.mark.parametrize(("kwargs", "field"), ERRORS.values(), ids=ERRORS.keys())
def test_invalid_request(tok: Any, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate(tok, pb.GenerationParams(**kwargs))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_messages_state_the_numbers(tok: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"token id 50000 is outside the vocabulary \(size 49152\)"):
        validate(tok, pb.GenerationParams(token_ids=pb.TokenIds(ids=[1, 2, 3, 50000])))
    with pytest.raises(InvalidRequestError, match=r"^params.sampling.top_p: must be in \(0, 1\], got 1.5$"):
        validate(tok, pb.GenerationParams(**sampling(top_p=1.5)))
    n = len(tok("Hello")["input_ids"])
    with pytest.raises(InvalidRequestError, match=rf"\({n} tokens\) \+ max_tokens \(64\) exceeds the context length 64"):
        validate(tok, pb.GenerationParams(**sampling(max_tokens=64)))


def test_chat_template_errors_become_invalid_request(tok: Any) -> None:
    from jinja2.exceptions import TemplateError

    class Strict:
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            raise TemplateError("Conversation roles must alternate")

    with pytest.raises(InvalidRequestError) as info:
        validate(Strict(), pb.GenerationParams(chat=chat(("user", "a"), ("user", "b"))))
    assert info.value.field == "params.chat.messages" and "alternate" in str(info.value)


# ---- valid requests --------------------------------------------------------


def test_text_prompt_and_defaults(tok: Any) -> None:
    v = validate(tok, pb.GenerationParams(text="Hello world"))
    assert list(v.prompt_token_ids) == tok("Hello world")["input_ids"]
    s = v.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.0, 1.0, 0, SEED)
    assert s.max_tokens == 64 - len(v.prompt_token_ids)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == ((), frozenset(), False)
    assert len(v.request_id) == 32 and int(v.request_id, 16) >= 0


def test_request_ids_are_unique_or_echoed(tok: Any) -> None:
    a, b = (validate(tok, pb.GenerationParams(text="hi")).request_id for _ in range(2))
    assert a != b
    assert validate(tok, pb.GenerationParams(text="hi", request_id="my-id 7")).request_id == "my-id 7"


def test_cache_salt_is_carried(tok: Any) -> None:
    assert validate(tok, pb.GenerationParams(text="hi")).cache_salt == ""
    salt = "tenant-é" * 32                      # 256 characters, any text
    assert validate(tok, pb.GenerationParams(text="hi", cache_salt=salt)).cache_salt == salt


def test_token_ids_pass_through(tok: Any) -> None:
    v = validate(tok, pb.GenerationParams(token_ids=pb.TokenIds(ids=[0, 5, VOCAB - 1])))
    assert v.prompt_token_ids == (0, 5, VOCAB - 1)


def test_chat_renders_the_model_template(tok: Any) -> None:
    msgs = chat(("user", "What is 2+2?"), ("assistant", ""), ("user", "Well?"))
    v = validate(tok, pb.GenerationParams(chat=msgs), ModelLimits(VOCAB, 8192))
    text = tok.decode(list(v.prompt_token_ids))
    assert text.startswith("<|im_start|>system")
    assert text.endswith("<|im_start|>user\nWell?<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in msgs.messages],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == own


def test_explicit_sampling_is_kept(tok: Any) -> None:
    params = pb.GenerationParams(**sampling(
        temperature=0.5, top_p=0.25, top_k=VOCAB, seed=0, max_tokens=3,
        stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True,
    ))
    s = validate(tok, params).sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (0.5, 0.25, VOCAB, 0, 3)
    assert s.stop == ("\n\n", "END") and s.stop_token_ids == frozenset({2, 7}) and s.ignore_eos


def test_new_sampling_fields_are_kept_or_defaulted(tok: Any) -> None:
    s = validate(tok, pb.GenerationParams(**sampling())).sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert (s.logit_bias, s.min_tokens, s.top_logprobs, s.prompt_logprobs, s.n) == ((), 0, 0, None, 1)
    s = validate(tok, pb.GenerationParams(**sampling(
        min_p=0.05, repetition_penalty=1.2, presence_penalty=-2, frequency_penalty=2,
        logit_bias={9: -100.0, 3: 0.5}, min_tokens=3, max_tokens=3, top_logprobs=20, prompt_logprobs=0, n=16,
    ))).sampling
    assert math.isclose(s.min_p, 0.05, rel_tol=1e-6) and math.isclose(s.repetition_penalty, 1.2, rel_tol=1e-6)
    assert (s.presence_penalty, s.frequency_penalty) == (-2.0, 2.0)
    assert s.logit_bias == ((3, 0.5), (9, -100.0))
    assert (s.min_tokens, s.top_logprobs, s.prompt_logprobs, s.n) == (3, 20, 0, 16)


def test_max_tokens_may_fill_the_context(tok: Any) -> None:
    v = validate(tok, pb.GenerationParams(token_ids=pb.TokenIds(ids=[5] * 63), sampling={"max_tokens": 1}))
    assert v.sampling.max_tokens == 1


def test_tokenize(tok: Any) -> None:
    assert validate_tokenize(pb.TokenizeRequest(text="Hello"), tok, LIMITS) == tok("Hello")["input_ids"]
    long = " word" * 150  # tokenize is not held to the context length
    assert len(validate_tokenize(pb.TokenizeRequest(text=long), tok, LIMITS)) == 150
    req = pb.TokenizeRequest(chat=chat(("user", "hi")))
    gen = validate(tok, pb.GenerationParams(chat=chat(("user", "hi"))))
    assert validate_tokenize(req, tok, LIMITS) == list(gen.prompt_token_ids)


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (pb.TokenizeRequest(), "input"),
        (pb.TokenizeRequest(text=""), "text"),
        (pb.TokenizeRequest(chat=pb.ChatPrompt()), "chat.messages"),
        (pb.TokenizeRequest(chat=chat(("user", "a"), ("bot", "b"))), "chat.messages[1].role"),
    ],
)
def test_tokenize_errors(tok: Any, req: pb.TokenizeRequest, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_tokenize(req, tok, LIMITS)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


# ---- property test ---------------------------------------------------------

FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([0.0, 0.5, 1.0, 2.0])
ROLES = st.sampled_from(["system", "user", "assistant"]) | st.sampled_from(["tool", ""]) | st.text(max_size=5)
ASCII = st.characters(min_codepoint=32, max_codepoint=126)
REQUEST_IDS = st.just("") | st.text(ASCII, max_size=8) | st.text(max_size=3) | st.text(ASCII, min_size=126, max_size=130)
MESSAGES = st.lists(st.builds(pb.ChatMessage, role=ROLES, content=st.text(max_size=30)), max_size=4)
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40) | st.lists(
    st.integers(0, VOCAB + 10) | st.integers(0, 2**32 - 1), max_size=70)
PROMPTS = st.one_of(
    st.just({}),
    st.builds(lambda t: {"text": t}, st.text(min_size=1, max_size=60) | st.text(max_size=2)),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, IDS),
    st.builds(lambda m: {"chat": pb.ChatPrompt(messages=m)}, MESSAGES),
)
OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "temperature": FLOATS, "top_p": FLOATS,
    "top_k": st.integers(0, 2**32 - 1) | st.integers(0, VOCAB + 1),
    "seed": st.integers(0, 2**64 - 1),
    "max_tokens": st.integers(0, 2**32 - 1) | st.integers(0, 70),
    "stop": st.lists(st.text(max_size=3) | st.text(min_size=250, max_size=260), max_size=18),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 10), max_size=4),
    "ignore_eos": st.booleans(),
}
SAMPLING = st.fixed_dictionaries({}, optional=OPTIONAL).map(lambda kw: pb.SamplingParams(**kw))


@settings(max_examples=200, deadline=None)
@given(prompt=PROMPTS, s=SAMPLING, request_id=REQUEST_IDS)
def test_random_requests_pass_within_limits_or_fail_cleanly(
    tok: Any, prompt: dict[str, Any], s: pb.SamplingParams, request_id: str
) -> None:
    params = pb.GenerationParams(**prompt, sampling=s, request_id=request_id)
    try:
        v = validate(tok, params)
    except InvalidRequestError as e:
        assert e.field.startswith("params.") and str(e).startswith(f"{e.field}: ")
        event(f"rejected: {e.field.split('[')[0]}")
        return
    event("accepted")
    n, o = len(v.prompt_token_ids), v.sampling
    assert 1 <= n < LIMITS.context_length and n + o.max_tokens <= LIMITS.context_length
    assert o.max_tokens >= 1 and all(0 <= t < VOCAB for t in v.prompt_token_ids)
    assert math.isfinite(o.temperature) and 0 <= o.temperature <= 100
    assert 0 < o.top_p <= 1 and 0 <= o.top_k <= VOCAB
    assert len(o.stop) <= LIMITS.max_stop_strings
    assert all(1 <= len(x) <= LIMITS.max_stop_string_chars for x in o.stop)
    assert all(t < VOCAB for t in o.stop_token_ids)
    assert 1 <= len(v.request_id) <= 128 and v.request_id.isprintable()
