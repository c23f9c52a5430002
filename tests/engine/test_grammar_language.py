"""Specifications that accept no output are refused when they arrive (engine/grammar/): EBNF
grammars and regexes built at random around parts that match nothing, each refused exactly when
its language is empty (the same shapes with a way out are accepted); JSON schemas whose
contradiction xgrammar misses or keeps in its grammar; and, with a tokenizer that cannot spell
a grammar's first character, the compile's check."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import StructuredOutputsParams
from engine.grammar.compiler import Grammars

pytest.importorskip("xgrammar")

# (part, whether it matches nothing): "never" never ends, "[^\0-\U0010ffff]" holds no
# character, "loop" is left-recursive with a way out
EBNF_PARTS = [('"ab"', False), ("[a-z]", False), ('""', False), ("loop", False),
              ("never", True), ("[^\\0-\\U0010ffff]", True)]
EBNF_RULES = '\nnever ::= "x" never\nloop ::= loop "q" | "q"\n'
REGEX_PARTS = [("a", False), ("[0-9]", False), ("\\d", False), ("[^\\s\\S]", True)]


def combined(parts: list[tuple[str, bool]], alt: str):
    """Random expressions over ``parts``, each with whether its language is empty: a
    sequence is empty when a part is, a choice when both are, ``{m,n}`` and ``+`` when the
    part is and m > 0, ``?`` and ``*`` never."""
    def extend(inner):
        pair = st.tuples(inner, inner)
        return st.one_of(
            pair.map(lambda p: (f"{p[0][0]} {p[1][0]}" if alt == " | " else p[0][0] + p[1][0],
                                p[0][1] or p[1][1])),
            pair.map(lambda p: (f"({p[0][0]}{alt}{p[1][0]})", p[0][1] and p[1][1])),
            st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
                lambda p: (f"({p[0][0]}){{{p[1]},{p[1] + p[2]}}}", p[1] > 0 and p[0][1])),
            inner.map(lambda p: (f"({p[0]})?", False)),
            inner.map(lambda p: (f"({p[0]})*", False)),
            inner.map(lambda p: (f"({p[0]})+", p[1])))
    expr = st.recursive(st.sampled_from(parts), extend, max_leaves=6)
    sep = " " if alt == " | " else ""
    nothing = st.sampled_from([p for p in parts if p[1]])
    return st.one_of(expr, st.tuples(expr, nothing, expr).map(  # half with a part that
        lambda p: (f"{p[0][0]}{sep}{p[1][0]}{sep}{p[2][0]}", True)))  # matches nothing


def refused(spec: dict) -> str | None:
    try:
        StructuredOutputsParams(**spec).validate()
    except ValueError as e:
        return str(e)
    return None


@settings(max_examples=150, deadline=None)
@given(combined(EBNF_PARTS, " | "))
def test_random_grammars_are_refused_exactly_when_they_accept_nothing(expr):
    text, empty = expr
    message = refused({"grammar": f"root ::= {text}{EBNF_RULES}"})
    assert message == ("structured_outputs.grammar is unsatisfiable: it accepts no string "
                       "(its root rule never completes)" if empty else None), text


@settings(max_examples=150, deadline=None)
@given(combined(REGEX_PARTS, "|"))
def test_random_regexes_are_refused_exactly_when_they_match_nothing(expr):
    text, empty = expr
    message = refused({"regex": text})
    assert message == ("structured_outputs.regex is unsatisfiable: the regex matches no string"
                       if empty else None), text


NOTHING = {"type": "string", "pattern": "[^\\s\\S]"}  # xgrammar keeps it: an empty class
UNSATISFIABLE_SCHEMAS = [  # (schema, why), with a satisfiable twin below
    ({"allOf": [{"type": "string"}, {"type": "integer"}]},
     "/allOf: the types (string; integer) have no value in common"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "null"}, {"type": "boolean"}]}},
      "required": ["a"]}, "/properties/a/allOf: the types (null; boolean) have no value in "
     "common"),
    ({"type": []}, "/: type is an empty list"),
    ({"anyOf": []}, "/: anyOf is empty"),
    ({"oneOf": [{"type": []}, {"not": {}}]},
     "/oneOf/0: type is an empty list; /oneOf/1: not: {} excludes every value"),
    ({"type": "array", "minItems": 2, "items": {"anyOf": []}}, "/items: anyOf is empty"),
    ({"type": "object", "properties": {"a": NOTHING}, "required": ["a"]},
     "no JSON value satisfies the schema"),
    ({"type": "array", "items": NOTHING, "minItems": 1}, "no JSON value satisfies the schema"),
    (NOTHING, "no JSON value satisfies the schema"),
]
SATISFIABLE_TWINS = [
    {"allOf": [{"type": "number"}, {"type": "integer"}]},
    {"type": "object", "properties": {"a": {"allOf": [{"type": "null"}]}}, "required": ["a"]},
    {"type": ["null"]},
    {"anyOf": [{"type": "null"}]},
    {"oneOf": [{"type": []}, {"type": "null"}]},
    {"type": "array", "minItems": 0, "items": {"anyOf": []}},
    {"type": "object", "properties": {"a": NOTHING}},
    {"type": "array", "items": NOTHING},
    {"type": "string", "pattern": "[^\\s\\S]|x"},
]


@pytest.mark.parametrize("schema, why", UNSATISFIABLE_SCHEMAS,
                         ids=[str(i) for i in range(len(UNSATISFIABLE_SCHEMAS))])
def test_unsatisfiable_schemas_are_refused_naming_why(schema, why):
    assert refused({"json": schema}) == f"structured_outputs.json is unsatisfiable: {why}"
    assert refused({"json": json.dumps(schema)}) is not None  # the same as JSON text


@pytest.mark.parametrize("schema", SATISFIABLE_TWINS,
                         ids=[str(i) for i in range(len(SATISFIABLE_TWINS))])
def test_their_satisfiable_twins_are_accepted(schema):
    assert refused({"json": schema}) is None


def test_a_grammar_no_token_can_start_fails_its_compile():
    """A word-level tokenizer spells "a", "b", "ab": ``"c"`` is a language, but not one this
    model can write; the first token's mask says so."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "ab": 2, "</s>": 3}, unk_token="</s>"))
    grammars = Grammars(PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>"), 4,
                        [3], timeout_s=30)
    for spec in ['root ::= "c"', 'root ::= "c" | "c" "c"']:
        params = StructuredOutputsParams(grammar=spec)
        params.validate()  # not empty over characters
        with pytest.raises(ValueError, match=re.escape(
                "structured_outputs.grammar is unsatisfiable with this model's tokenizer: no "
                "token can start an output it accepts")):
            grammars.state(params).compiled.result(timeout=30)
    for spec in ['root ::= "ab" | "c"', 'root ::= ""']:
        assert grammars.state(StructuredOutputsParams(grammar=spec)).compiled.result(30)
