"""Random JSON schemas of tool parameters, for the property tests of the tool
grammars: objects of string / integer / number / boolean / enum / array /
nested-object properties, with random required subsets."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

NAMES = st.sampled_from(["a", "city", "n", "flag", "items", "x_y"])
LEAVES = st.one_of(
    st.just({"type": "string"}), st.just({"type": "integer"}), st.just({"type": "number"}),
    st.just({"type": "boolean"}), st.just({"enum": ["red", "green", 3]}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)))


def _object(props: dict[str, Any], required: list[bool]) -> dict[str, Any]:
    names = list(props)
    return {"type": "object", "properties": props,
            "required": [n for n, r in zip(names, required) if r]}


def objects(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(NAMES, inner, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda req: _object(props, req)))


SCHEMAS = objects(st.recursive(LEAVES, lambda inner: st.one_of(
    objects(inner), st.builds(lambda s: {"type": "array", "items": s, "maxItems": 3}, inner)), max_leaves=5))
