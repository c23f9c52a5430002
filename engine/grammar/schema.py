"""JSON-schema contradictions that xgrammar does not see.

xgrammar refuses some schemas that accept nothing itself (``minLength`` over ``maxLength``,
an empty ``enum``, ``false``), and the grammar it builds from the others is checked by
``language.grammar_is_empty``. A few keywords it drops or loosens instead: ``allOf`` of several
schemas (it warns, and keeps less than all of them), ``not``, an empty ``type`` list or
``anyOf`` (the grammar then accepts what the schema refuses, even the empty output). When such
a keyword leaves the schema with no value at all, ``contradiction`` says where.
"""

from __future__ import annotations

from typing import Any


def contradiction(schema: Any, path: str = "") -> str | None:
    """Where and why ``schema`` accepts no value, when one of these makes it so: ``false``, an
    empty ``type`` list, ``anyOf`` / ``oneOf`` empty or of schemas that accept nothing, ``not``
    of a schema that accepts everything, ``allOf`` with a member that accepts nothing or whose
    members' types have none in common; below a schema whose type is only ``object`` (or only
    ``array``), a required property (or, with ``minItems`` >= 1, the items) that accepts
    nothing. None otherwise, which does not prove that some value is accepted."""
    at = path or "/"  # a JSON pointer into the schema
    if schema is False:
        return f"{at}: false"
    if not isinstance(schema, dict):
        return None
    types = _types(schema)
    if types is not None and not types:
        return f"{at}: type is an empty list"
    if schema.get("not") in ({}, True):
        return f"{at}: not: {schema['not']} excludes every value"
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list):
            reasons = [contradiction(m, f"{path}/{key}/{i}") for i, m in enumerate(members)]
            if not members:
                return f"{at}: {key} is empty"
            if all(reasons):
                return "; ".join(r for r in reasons if r)
    return _all_of(schema, types, path) or _below(schema, types, path)


def _types(schema: dict[str, Any]) -> set[str] | None:
    """The types ``schema`` allows by its ``type`` keyword (None: any)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _meet(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    """The types both allow; an integer is a number."""
    if a is None or b is None:
        return b if a is None else a
    both = a & b
    if ("number" in a and "integer" in b) or ("integer" in a and "number" in b):
        both.add("integer")
    return both


def _all_of(schema: dict[str, Any], types: set[str] | None, path: str) -> str | None:
    members = schema.get("allOf")
    if not isinstance(members, list):
        return None
    common = types
    for i, member in enumerate(members):
        reason = contradiction(member, f"{path}/allOf/{i}")
        if reason:
            return reason
        if isinstance(member, dict):
            common = _meet(common, _types(member))
    if common is not None and not common:
        named = [sorted(t) for t in [types, *(_types(m) for m in members if isinstance(m, dict))]
                 if t is not None]
        return (f"{path}/allOf: the types ({'; '.join(', '.join(t) for t in named)}) have "
                f"no value in common")
    return None


def _below(schema: dict[str, Any], types: set[str] | None, path: str) -> str | None:
    """A required property, or the items of a non-empty array, that accepts nothing."""
    if types == {"object"}:
        properties = schema.get("properties")
        for name in schema.get("required") or []:
            if isinstance(properties, dict) and isinstance(name, str) and name in properties:
                reason = contradiction(properties[name], f"{path}/properties/{name}")
                if reason:
                    return reason
    min_items = schema.get("minItems")
    if types == {"array"} and isinstance(min_items, int) and min_items >= 1:
        return contradiction(schema.get("items", True), f"{path}/items")
    return None
