"""Structured output (guided decoding) on xgrammar: a request's output is held to a JSON schema,
any JSON object, a regular expression, one of a list of strings, or an EBNF grammar.

``StructuredOutputsParams`` (``SamplingParams.structured_outputs``, as vLLM's) says which; its
``validate`` parses the grammar without a tokenizer (cached), so a bad schema, regex or grammar
is a ``ValueError`` naming it when the request arrives, and so is one that accepts no output
at all (``engine.grammar.language``, ``engine.grammar.schema``). ``engine.grammar.compiler``
compiles it against the tokenizer off the step loop, within a time bound, and holds each
sequence's matcher: before sampling, the matchers of the batch's constrained rows fill one
token bitmask and one call masks the logits (``engine.sample.sampler.mask_logits``); each
appended token advances its matcher, and a matcher that reaches the grammar's end finishes its
sequence ("stop"). A sequence that reaches ``max_tokens`` first ends with "length".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from engine.grammar.language import EMPTY_LANGUAGE, grammar_is_empty
from engine.grammar.schema import contradiction

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20  # characters of a schema, regex or grammar
MAX_CHOICES = 1024
_CACHE_SIZE = 256  # parsed grammars kept


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (EBNF, xgrammar's dialect, rule
    ``root``) or ``json_object=True`` (any JSON object)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def kind(self) -> str:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        return given[0]

    def key(self) -> tuple[str, str]:
        """(kind, the grammar's text): what the compile cache is keyed by."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            text = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            _require(isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                     and all(isinstance(c, str) and c for c in value),
                     f"structured_outputs.choice must be a list of 1-{MAX_CHOICES} non-empty "
                     f"strings")
            text = json.dumps(value)
        elif kind == "json_object":
            _require(value is True, "structured_outputs.json_object must be true")
            text = ""
        else:
            what = "a schema object or its JSON text" if kind == "json" else "a string"
            _require(isinstance(value, str), f"structured_outputs.{kind} must be {what}, got "
                     f"{type(value).__name__}")
            text = value
        _require(len(text) <= MAX_SPEC_CHARS, f"structured_outputs.{kind} is {len(text)} "
                 f"characters long; at most {MAX_SPEC_CHARS} are accepted")
        return kind, text

    def validate(self) -> None:
        """``ValueError`` naming what is wrong: the fields, or the schema, regex or grammar."""
        parse_grammar(*self.key())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@lru_cache(maxsize=_CACHE_SIZE)
def parse_grammar(kind: str, text: str) -> xgrammar.Grammar:
    """The xgrammar ``Grammar`` of a (kind, text) key; ``ValueError`` naming the field if it
    does not parse, or if no output satisfies it."""
    grammar = _parse(kind, text)
    reason = contradiction(json.loads(text)) if kind == "json" else None
    if reason is None and grammar_is_empty(grammar):
        reason = EMPTY_LANGUAGE[kind]
    if reason is not None:
        raise ValueError(f"structured_outputs.{kind} is unsatisfiable: {reason}")
    return grammar


def _parse(kind: str, text: str) -> xgrammar.Grammar:
    import xgrammar as xgr

    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
            return xgr.Grammar.from_ebnf(_strict_strings(str(grammar)))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.builtin_json_grammar()
    except (RuntimeError, ValueError) as e:  # xgrammar reports parse errors as RuntimeError
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"structured_outputs.{kind} is invalid: {detail[:300]}") from None


# xgrammar 0.2.9 writes the characters of a length-bounded string (maxLength, minLength) as
# "anything but a quote, a backslash, CR or LF": control characters, which JSON forbids raw
# (json.loads refuses them), slip through. Its unbounded strings exclude all of U+0000-U+001F.
_LAX_CHARS, _JSON_CHARS = r'[^\"\\\r\n]', r'[^\"\\\0-\x1f]'


def _strict_strings(ebnf: str) -> str:
    return ebnf.replace(_LAX_CHARS, _JSON_CHARS)


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices``, each matched literally."""
    def literal(s: str) -> str:
        escaped = "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                          if ord(c) < 0x10000 else c for c in s)
        return f'"{escaped}"'
    return "root ::= " + " | ".join(literal(c) for c in choices)
