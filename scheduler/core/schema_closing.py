"""Closing a JSON schema's objects: every object schema that does not set
``additionalProperties`` gets ``false`` (OpenAI's strict json_schema
semantics), except where closing would change what the schema admits."""

from __future__ import annotations

import json
from typing import Any


# Keywords whose values are schemas, or maps / lists of schemas, that apply to
# the instance or its parts: what close_objects walks into. Not "not" (closing
# an object inside a negation would widen what the schema admits), nor
# if/then/else or dependentSchemas (conditional: llguidance rejects them).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "contains")
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_LOCAL_DEFS = ("#/$defs/", "#/definitions/")


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and ("properties" in node or "patternProperties" in node)


def _intersects(node: dict[str, Any]) -> bool:
    """``node`` is the intersection of object schemas: its allOf members, or
    its own object keywords and its $ref or each of its anyOf/oneOf members.
    Closing any of the parts would refuse the keys that another part declares."""
    return "allOf" in node or (_is_object_schema(node) and any(k in node for k in ("anyOf", "oneOf", "$ref")))


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas that set neither
    ``additionalProperties`` nor ``unevaluatedProperties`` get
    ``"additionalProperties": false``: every level (properties, items,
    anyOf/oneOf members, $defs/definitions, ...). Left as written, because
    closing them would refuse keys the schema allows: a schema that
    intersects objects (``allOf``, or object keywords beside $ref or
    anyOf/oneOf), its direct members, and the local ``$defs`` such a part
    refers to; what lies inside them is closed."""
    # A copy through JSON, not copy.deepcopy: that keeps a dict used at two places
    # one dict, and closing it at one place would close it at the other.
    schema = json.loads(json.dumps(schema))
    parts: set[str] = set()                          # "#/$defs/X" refs that are intersection members

    def find_parts(node: Any) -> None:
        if isinstance(node, dict):
            if _intersects(node):
                if isinstance(node.get("$ref"), str):
                    parts.add(node["$ref"])
                for key in _COMBINATORS:
                    for member in node.get(key) or ():
                        if isinstance(member, dict) and isinstance(member.get("$ref"), str):
                            parts.add(member["$ref"])
            for value in node.values():
                find_parts(value)
        elif isinstance(node, list):
            for value in node:
                find_parts(value)

    def close(node: Any, is_part: bool) -> None:
        if not isinstance(node, dict):
            return
        if (_is_object_schema(node) and not is_part and not _intersects(node)
                and "additionalProperties" not in node and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                for name, sub in value.items():
                    close(sub, key in ("$defs", "definitions")
                          and any(ref == prefix + name for ref in parts for prefix in _LOCAL_DEFS))
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                members_are_parts = key in _COMBINATORS and _intersects(node)
                for sub in value:
                    close(sub, members_are_parts)
        for key in _SCHEMA_VALUES:
            value = node.get(key)
            for sub in value if isinstance(value, list) else [value]:   # items: a schema or (old) a list
                close(sub, False)

    find_parts(schema)
    close(schema, False)
    return schema
