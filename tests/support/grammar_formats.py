"""Structured-output formats and masks as the grammar tests use them, on the
served tokenizer (SmolLM2's): a format from a JSON schema, the ids a matcher
allows, a text's ids, and a nested schema with two documents it accepts.
The fixtures (tokenizer, compiler, ...) are in tests/scheduler/conftest.py."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jitney.scheduler.core.grammar import GrammarMatcher, allocate_bitmask
from jitney.v1 import generation_pb2 as pb

PAD = 37          # the model's head is this much wider than the tokenizer


def schema(s: Any, *, lenient: bool = False) -> pb.ResponseFormat:
    return pb.ResponseFormat(json_schema=json.dumps(s), lenient_json=lenient)


def allowed(m: GrammarMatcher, vocab: int) -> np.ndarray:
    out = allocate_bitmask(1, vocab)[0]
    m.fill_bitmask(out)
    return np.flatnonzero(np.unpackbits(out.view(np.uint8), bitorder="little"))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


EOS = 2   # SmolLM2's <|im_end|>

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "kind": {"enum": ["book", "film", "song"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "author": {"type": "object",
                   "properties": {"name": {"type": "string", "maxLength": 30},
                                  "alive": {"type": "boolean"}},
                   "required": ["name"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "note": {"type": ["string", "null"], "maxLength": 40},
    },
    "required": ["id", "kind", "rating", "author"],
    "additionalProperties": False,
}
NESTED_DOCS = [
    {"id": "AB-123", "kind": "book", "rating": 4.5, "year": 1999,
     "author": {"name": "Zoë \"Z\" Brontë", "alive": False}, "tags": ["a\\b", "x\ty"], "note": None},
    {"id": "XY-000", "kind": "song", "rating": 0, "author": {"name": "山田"}, "note": "é 🙂"},
]


