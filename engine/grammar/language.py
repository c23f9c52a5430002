"""Whether a grammar's language holds any string, and whether the model can start one.

xgrammar compiles grammars that accept nothing (``root ::= root``, ``root ::= "a" root``, a
regex with a character class that holds no character, a schema whose required property has
such a pattern) without complaint. The engine then finds no token to sample at the first step,
or samples until ``max_tokens`` without ever reaching the end. Two checks refuse them:

- ``grammar_is_empty`` (without a tokenizer, at intake): the textbook emptiness test of a
  context-free grammar, run on xgrammar's normalized form (its JSON serialization). A part is
  productive when it can match some string: a literal, a non-empty character class, a
  ``[...]*``, ``""``; a sequence when all its parts are, a choice when one is, a rule when its
  body is, ``x{m,n}`` when ``m == 0`` or ``x`` is. The language is empty exactly when the root
  rule is not productive. Lookahead assertions are not looked at: they only remove strings, so
  "empty" is exact and "not empty" may miss a grammar emptied by its lookaheads.
- ``first_token_possible`` (after compiling against the tokenizer): the matcher's first token
  bitmask allows some token, or the grammar accepts the empty output. A language that is not
  empty over characters may still need a character no token spells (a tokenizer without byte
  fallback); this is what the first step's mask will be.
"""

from __future__ import annotations

import json
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

# xgrammar's serialized grammar (format "v18": xgrammar 0.2.x): each expression is
# [type, data length, data...]; the types, in the order of its GrammarExprType
_FORMAT = "v18"
BYTES, CLASS, CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)
_NEVER = 1 << 62  # what a part that can match nothing waits for
_CODEPOINTS = ((0, 0xD7FF), (0xE000, 0x10FFFF))  # what a character class draws from


def grammar_is_empty(grammar: xgrammar.Grammar) -> bool | None:
    """True when no string is in ``grammar``'s language, False when one is, None when this
    xgrammar serializes grammars in a form this does not read."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != _FORMAT:
        return None
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    bodies = [rule[1] for rule in data["rules"]]
    productive = _productive(flat, starts, bodies)
    return not productive[len(starts) + data["root_rule_id"]]


def _productive(flat: list[int], starts: list[int], bodies: list[int]) -> list[bool]:
    """Which nodes (the expressions, then the rules) can match some string. Expression ``i``
    is ``flat[starts[i]:]``: its type, its data's length, its data. Each node waits for
    ``need`` of its children; it is productive once that many are (a worklist: the cost is
    linear in the grammar's size)."""
    n = len(starts)
    need = [0] * (n + len(bodies))
    parents: list[list[int]] = [[] for _ in need]
    for i, start in enumerate(starts):
        kind, size = flat[start], flat[start + 1]
        if kind == SEQUENCE or kind == CHOICES:
            for child in flat[start + 2:start + 2 + size]:
                parents[child].append(i)
            need[i] = size if kind == SEQUENCE else (1 if size else _NEVER)
        elif kind == RULE_REF or (kind == REPEAT and flat[start + 3] > 0):
            parents[n + flat[start + 2]].append(i)
            need[i] = 1
        elif kind == CLASS and not _class_holds_a_character(flat[start + 2:start + 2 + size]):
            need[i] = _NEVER
    for rule, body in enumerate(bodies):
        parents[body].append(n + rule)
        need[n + rule] = 1
    productive = [w == 0 for w in need]
    queue = deque(i for i, ok in enumerate(productive) if ok)
    while queue:
        for parent in parents[queue.popleft()]:
            need[parent] -= 1
            if need[parent] == 0:
                productive[parent] = True
                queue.append(parent)
    return productive


def _class_holds_a_character(args: list[int]) -> bool:
    """[negated, lo0, hi0, lo1, hi1, ...]: whether some codepoint is in the class."""
    ranges = sorted(zip(args[1::2], args[2::2], strict=True))
    if not args[0]:
        return any(lo <= hi for lo, hi in ranges)
    for first, last in _CODEPOINTS:  # negated: a codepoint that no range covers
        for lo, hi in ranges:
            if lo > first:
                break
            first = max(first, hi + 1)
        if first <= last:
            return True
    return False


def first_token_possible(compiled: xgrammar.CompiledGrammar) -> bool:
    """Whether a fresh matcher of ``compiled`` allows some token, or accepts the empty
    output (its stop tokens are then allowed)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_completed():
        return True
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


# what an empty language means, said for each kind of specification
EMPTY_LANGUAGE = {"json": "no JSON value satisfies the schema",
                  "regex": "the regex matches no string",
                  "grammar": "it accepts no string (its root rule never completes)",
                  "choice": "it accepts no string", "json_object": "it accepts no string"}
