"""Checking an answer: whether it belongs to its request and keeps the service's promises.

A response is checked to belong to its request: every request carries a unique
``X-Request-Id`` that the response ``id`` must end with, and valid requests are greedy
(``temperature`` 0, ``ignore_eos``) over a fixed pool of prompts, so the text of each choice
must equal the reference recorded for its (prompt, ``max_tokens``, endpoint) the first time it
was answered; ``usage.prompt_tokens`` must match the reference too, and ``completion_tokens``
must be exactly ``max_tokens`` per choice. A list of two prompts with ``n`` = 2 must come back
as four choices, each equal to its own prompt's reference. Error responses must be in OpenAI's
shape, a 429 must carry ``Retry-After``, and bad input must get exactly its 4xx.
"""

from __future__ import annotations

import json
from typing import Any

from .spec import References, Spec, Verdict

ERROR_KEYS = {"message", "type", "param", "code"}


def is_error_shape(obj: Any) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"error"} and isinstance(obj["error"], dict)
            and set(obj["error"]) == ERROR_KEYS and isinstance(obj["error"]["message"], str))


def verify(spec: Spec, status: int, headers: dict[str, str], payload: bytes | list[str],
           refs: References, done: bool = True) -> Verdict:
    """Judge one answer. ``payload``: the body, or for a 200 stream the SSE data payloads in
    order (``done``: the stream ended normally; False if it was cut or dropped on purpose)."""
    if spec.bad:
        return _verify_bad(spec, status, headers, payload)
    if status == 200 and spec.stream and isinstance(payload, list):
        return _verify_stream(spec, payload, refs, done)
    if status == 200:
        try:
            body = json.loads(payload)
        except ValueError:
            return Verdict("failed", [("belongs", f"{spec.request_id}: 200 with a non-JSON body")])
        return _verify_final(spec, body, refs)
    return _verify_error(spec, status, headers, payload)


def _verify_bad(spec: Spec, status: int, headers: dict[str, str], payload: Any) -> Verdict:
    if spec.edge:
        if status == 200:
            return Verdict("completed")
        if status == 429:  # valid input: the admission bound applies to it as to any other
            return _verify_error(spec, status, headers, payload)
        return Verdict("failed", [("bad_input_4xx", f"{spec.kind}: got {status}, expected 200: "
                                   f"{_head(payload)}")], _shaped(payload), detail=str(status))
    shaped = _shaped(payload)
    problems = []
    if status != spec.expect:
        problems.append(("bad_input_4xx", f"{spec.kind}: got {status}, expected {spec.expect}"))
    if not shaped:
        problems.append(("errors_openai_shape", f"{spec.kind}: {status} body {_head(payload)}"))
    category = "rejected" if status == spec.expect else "failed"
    return Verdict(category, problems, shaped, detail=str(status))


def _verify_error(spec: Spec, status: int, headers: dict[str, str], payload: Any) -> Verdict:
    shaped = _shaped(payload)
    problems = [] if shaped else [("errors_openai_shape", f"{spec.kind}: {status} body "
                                   f"{_head(payload)}")]
    if status == 429:
        retry = headers.get("retry-after") or headers.get("Retry-After")
        if not (retry and retry.isdigit() and int(retry) >= 1):
            problems.append(("overload_429", f"429 without a valid Retry-After ({retry!r})"))
        return Verdict("rejected", problems, shaped, detail="429")
    if 400 <= status < 500:  # a valid request must never be refused as invalid
        problems.append(("belongs", f"{spec.kind} {spec.request_id}: valid request got {status}: "
                         f"{_head(payload)}"))
    return Verdict("failed", problems, shaped, detail=str(status), sample=_head(payload))


def _verify_final(spec: Spec, body: dict, refs: References) -> Verdict:
    problems = _check_envelope(spec, body)
    choices = sorted(body.get("choices", []), key=lambda c: c.get("index", -1))
    texts = [c["message"]["content"] if "message" in c else c.get("text") for c in choices]
    finishes = [c.get("finish_reason") for c in choices]
    problems += _check_choices(spec, texts, finishes, body.get("usage"), refs)
    return Verdict("failed" if problems else "completed", problems)


def _verify_stream(spec: Spec, events: list[str], refs: References, done: bool) -> Verdict:
    problems: list[tuple[str, str]] = []
    if spec.disconnect_after is not None:
        return Verdict("disconnected")
    if not done or "[DONE]" not in events:
        return Verdict("failed", [], False, detail="stream_cut")
    if events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        problems.append(("belongs", f"{spec.request_id}: data after [DONE]: {events[-1][:60]}"))
    try:
        chunks = [json.loads(e) for e in events[:events.index("[DONE]")]]
    except ValueError:
        return Verdict("failed", [("belongs", f"{spec.request_id}: a non-JSON SSE event")])
    errors = [c for c in chunks if "error" in c]
    if errors:
        shaped = is_error_shape(errors[0])
        return Verdict("failed", [] if shaped else [("errors_openai_shape", str(errors[0]))],
                       shaped, detail="stream_error", sample=json.dumps(errors[0])[:120])
    num = len(spec.keys) * spec.n
    texts, finishes = [""] * num, [None] * num
    usage = None
    for chunk in chunks:
        problems += _check_envelope(spec, chunk)
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices", []):
            k = c.get("index")
            if not isinstance(k, int) or not 0 <= k < num:
                problems.append(("belongs", f"{spec.request_id}: choice index {k}"))
                continue
            if finishes[k] is not None and (c.get("finish_reason") or _piece(c)):
                problems.append(("belongs", f"{spec.request_id}: choice {k} answered after "
                                 "its finish"))
            texts[k] += _piece(c)
            finishes[k] = c.get("finish_reason") or finishes[k]
    problems += _check_choices(spec, texts, finishes, usage, refs)
    return Verdict("failed" if problems else "completed", problems)


def _piece(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _check_envelope(spec: Spec, body: dict) -> list[tuple[str, str]]:
    rid = body.get("id", "")
    if not isinstance(rid, str) or not rid.endswith(spec.request_id):
        return [("belongs", f"{spec.request_id}: response id {rid!r}")]
    return []


def _check_choices(spec: Spec, texts: list, finishes: list, usage: dict | None,
                   refs: References) -> list[tuple[str, str]]:
    num = len(spec.keys) * spec.n
    rid = spec.request_id
    if len(texts) != num:
        return [("belongs", f"{rid}: {len(texts)} choices, expected {num}")]
    problems = []
    if finishes != ["length"] * num:
        problems.append(("belongs", f"{rid}: finish reasons {finishes}"))
    for k, text in enumerate(texts):
        key = spec.keys[k // spec.n]
        if spec.echo is not None:
            if not text.startswith(spec.echo):
                problems.append(("belongs", f"{rid}: echo does not start with the prompt"))
                continue
            text = text[len(spec.echo):]
        bad = refs.check_text(key, text)
        if bad:
            problems.append(("belongs", f"{rid}: {bad}"))
    if not usage:
        return problems + [("belongs", f"{rid}: no usage")]
    if usage.get("completion_tokens") != spec.max_tokens * num:
        problems.append(("belongs", f"{rid}: completion_tokens {usage.get('completion_tokens')}"
                         f", expected {spec.max_tokens * num}"))
    if len(spec.keys) == 1:
        bad = refs.check_prompt_tokens(spec.keys[0], usage.get("prompt_tokens"))
        if bad:
            problems.append(("belongs", f"{rid}: {bad}"))
    return problems


def _shaped(payload: Any) -> bool:
    try:
        return is_error_shape(json.loads(payload))
    except (ValueError, TypeError):
        return False


def _head(payload: Any, limit: int = 120) -> str:
    text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else str(payload)
    return text[:limit]
