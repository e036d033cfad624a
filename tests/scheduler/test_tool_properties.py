"""Property: whatever tokens a model picks among those the tool grammar allows, every
call that comes out validates against its tool's schema, and the streamed argument
fragments concatenated are the call's whole arguments (and the same as parsing the
output in one piece). Random JSON schemas (objects of string / integer / number /
boolean / enum / array / nested-object properties, random required subsets) and
random tokens, on the grammar matcher directly."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitney.scheduler.api.tools.formats import GENERIC, HERMES, MISTRAL, ToolFormat
from jitney.scheduler.api.tools.grammar import tool_grammar
from jitney.scheduler.api.tools.spec import ToolRequest, ToolSpec
from jitney.scheduler.api.tools.stream import OutputParser
from jitney.scheduler.core.grammar import GrammarCompiler, allocate_bitmask
from tests.support.scripted_worker import EOS, VOCAB, make_tokenizer
from tests.support.tool_schemas import SCHEMAS
from tests.support.text_worker import walk_step



@pytest.fixture(scope="module")
def setup() -> tuple[Any, GrammarCompiler, list[str]]:
    tok = make_tokenizer()
    compiler = GrammarCompiler(tok, VOCAB, eos_token_ids=[EOS])
    return tok, compiler, [tok.decode([t]) for t in range(VOCAB)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1),
       choice=st.sampled_from(["auto", "required"]), parallel=st.booleans(),
       fmt=st.sampled_from([GENERIC, HERMES, MISTRAL]))
def test_random_walks_give_schema_valid_calls(setup: tuple[Any, GrammarCompiler, list[str]],
                                              schemas: list[dict[str, Any]], seed: int, choice: str,
                                              parallel: bool, fmt: ToolFormat) -> None:
    tok, compiler, texts = setup
    tools = tuple(ToolSpec(f"tool_{i}", "", s) for i, s in enumerate(schemas))
    req = ToolRequest(tools, choice, "", parallel)
    grammar = asyncio.run(compiler.compile_lark(tool_grammar(fmt, req), "params.tools"))
    matcher = grammar.new_matcher()
    rng = random.Random(seed)
    parser = OutputParser(fmt)
    streamed: dict[int, str] = {}
    output = ""
    ids: list[int] = []
    # auto: most walks first write some text and the marker (a random walk rarely spells it)
    lead = "ok " + fmt.open if choice == "auto" and rng.random() < 0.8 else ""
    mask = allocate_bitmask(1, VOCAB)[0]
    for _ in range(400):
        token = walk_step(matcher, mask, texts, lead, output, rng)
        if token == EOS:
            break
        ids.append(token)
        text = tok.decode(ids)         # whole characters only, as the detokenizer passes them on
        if text.endswith("\ufffd"):
            continue
        new, output = text[len(output):], text
        for d in parser.feed(new).calls:
            streamed[d.index] = streamed.get(d.index, "") + d.arguments
    else:
        return          # a walk that did not end: nothing complete to check
    parser.finish()
    by_name = {t.name: t.parameters for t in tools}
    if choice == "required":
        assert parser.calls
    if not parallel:
        assert len(parser.calls) <= 1
    whole = OutputParser(fmt)
    whole.feed(output)
    whole.finish()
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in parser.calls]
    for i, c in enumerate(parser.calls):
        jsonschema.validate(json.loads(c.arguments), by_name[c.name])
        assert streamed[i] == c.arguments


def test_compile_is_cached_per_tool_set(setup: tuple[Any, GrammarCompiler, list[str]]) -> None:
    _, compiler, _ = setup
    tools = tuple(ToolSpec(f"t{i}", "", {"type": "object", "properties": {"q": {"type": "string"}}})
                  for i in range(10))
    text = tool_grammar(HERMES, ToolRequest(tools, "required", "", True))

    async def twice() -> tuple[Any, Any]:
        return await compiler.compile_lark(text, "params.tools"), await compiler.compile_lark(text, "params.tools")
    first, second = asyncio.run(twice())
    assert first is second
    other = tool_grammar(HERMES, ToolRequest(tools[:9], "required", "", True))
    assert asyncio.run(compiler.compile_lark(other, "params.tools")) is not first
