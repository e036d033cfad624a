"""Every structured-output kind (json_schema, json_object, regex, choice, grammar in
GBNF or Lark) applies after a reasoning model's <think> block, as tool calls do:
the reasoning is free up to </think>, then the format holds; reasoning_content stays
apart from the content. Qwen3's real chat template (enable_thinking on and off) with
the tiny tokenizer; on the grammar matcher, then through the gRPC door."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from jitney.scheduler.api.tools.grammar import reasoned_grammar
from jitney.scheduler.core.grammar import GrammarCompiler, engine_grammar
from jitney.scheduler.core.request import InvalidRequestError
from jitney.v1 import generation_pb2 as pb
from tests.support.scripted_worker import EOS, VOCAB, make_tokenizer

QWEN3 = (Path(__file__).parents[1] / "support" / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
# kind -> (format, an answer it takes, one it refuses)
FORMATS: dict[str, tuple[pb.ResponseFormat, str, str]] = {
    "json_schema": (pb.ResponseFormat(json_schema='{"type": "object", "properties": {"answer": {"type": "string"}},'
                                                  ' "required": ["answer"]}'), '{"answer": "yes"}', '{"other": 1}'),
    "json_object": (pb.ResponseFormat(json_object=True), '{"a": 1}', "yes"),
    "regex": (pb.ResponseFormat(regex=r"\d{3}-[a-z]+/x"), "123-abc/x", "12-abc/x"),
    "choice": (pb.ResponseFormat(choice=pb.Choice(choices=["red", "green"])), "green", "blue"),
    "gbnf": (pb.ResponseFormat(grammar='root ::= "go " num\nnum ::= [0-9]+'), "go 42", "go x"),
    # rule names a reasoning head might use itself: the answer's grammar is kept apart
    "lark": (pb.ResponseFormat(grammar='start: main\nmain: REASON "!"\nREASON: /[ab]+/'), "abba!", "abc!"),
}


@pytest.fixture(scope="module")
def tok() -> Any:
    t = make_tokenizer()
    t.chat_template = QWEN3
    return t


@pytest.fixture(scope="module")
def compiler(tok: Any) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, eos_token_ids=[EOS])


def accepts(tok: Any, compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    matcher = asyncio.run(compiler.compile_toplevel(grammar, "params.response_format")).new_matcher()
    ids = list(tok(text, add_special_tokens=False)["input_ids"]) + [EOS]
    return all(matcher.accept_token(t) for t in ids)


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_each_kind_applies_after_the_reasoning(tok: Any, compiler: GrammarCompiler, kind: str) -> None:
    fmt, good, bad = FORMATS[kind]
    answer, _ = engine_grammar(fmt)
    maybe = reasoned_grammar(answer, "maybe")
    assert accepts(tok, compiler, maybe, "<think>\nIt is {not} JSON: 12-x\n</think>\n\n" + good)
    assert accepts(tok, compiler, maybe, good)                  # "maybe": no block at all
    assert not accepts(tok, compiler, maybe, "<think>ok</think>\n\n" + bad)
    assert not accepts(tok, compiler, maybe, "<think>a</think>b</think>" + good)   # one block only
    on = reasoned_grammar(answer, "on")
    assert accepts(tok, compiler, on, "already thinking</think>\n" + good)
    assert not accepts(tok, compiler, on, good)                 # "on": the block must close first


def test_a_format_that_does_not_compile_names_its_field(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidRequestError, match=r"params\.response_format\.grammar"):
        engine_grammar(pb.ResponseFormat(grammar="root ::= ("))
    answer, field = engine_grammar(pb.ResponseFormat(regex="a("))
    with pytest.raises(InvalidRequestError, match=r"params\.response_format\.regex"):
        asyncio.run(compiler.compile_toplevel(reasoned_grammar(answer, "maybe"), field))
    with pytest.raises(InvalidRequestError, match="choices"):
        engine_grammar(pb.ResponseFormat(choice=pb.Choice()))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Any:
    from tests.support.door_harness import text_worker_harness
    with text_worker_harness(tmp_path_factory.mktemp("ipc"), tok) as harness:
        yield harness


def params(fmt: pb.ResponseFormat, kwargs: str = "") -> pb.GenerationParams:
    p = pb.GenerationParams()
    p.chat.messages.add(role="user", content="pick one")
    p.chat.chat_template_kwargs = kwargs
    p.sampling.max_tokens = 100
    p.response_format.CopyFrom(fmt)
    return p


@pytest.mark.parametrize("kind", ["regex", "choice", "gbnf", "json_schema"])
def test_through_the_door_reasoning_then_the_format(server: Any, kind: str) -> None:
    fmt, good, _ = FORMATS[kind]
    server.worker.target = "<think>\nlet me see\n</think>\n\n" + good
    server.worker.spelled.clear()
    reply = server.stub.Generate(pb.GenerateRequest(params=params(fmt)), timeout=20)
    assert (reply.reasoning_content, reply.content) == ("\nlet me see\n", good)
    server.worker.spelled.clear()
    reasoning, content = "", ""
    for r in server.stub.GenerateStream(pb.GenerateStreamRequest(params=params(fmt)), timeout=20):
        reasoning += r.reasoning_content
        content += r.content
    assert (reasoning, content) == ("\nlet me see\n", good)
    # enable_thinking false: the template closed the block; the format holds from the first token
    server.worker.target = good
    server.worker.spelled.clear()
    off = server.stub.Generate(pb.GenerateRequest(params=params(fmt, '{"enable_thinking": false}')), timeout=20)
    assert (off.reasoning_content, off.content) == ("", good)


def test_through_the_door_a_bad_format_is_invalid_argument(server: Any) -> None:
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(pb.GenerateRequest(params=params(pb.ResponseFormat(grammar="root ::= ("))), timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.response_format.grammar" in (e.value.details() or "")


def test_the_split_streamed_equals_whole() -> None:
    from jitney.scheduler.api.tools.stream import OutputParser
    text = "<think>\nlet me see\n</think>\n\n go 42"
    whole = OutputParser(None, "maybe")
    whole.feed(text)
    whole.finish()
    for size in (1, 2, 5):
        parser = OutputParser(None, "maybe")
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert "".join(p.content for p in pieces) == parser.content == whole.content == "go 42"
        assert "".join(p.reasoning for p in pieces) == whole.reasoning == "\nlet me see\n"
    empty = OutputParser(None, "on")
    for piece in ("done</think>", "\n", "\n"):
        empty.feed(piece)
    empty.finish()
    assert (empty.reasoning, empty.content) == ("done", "")
