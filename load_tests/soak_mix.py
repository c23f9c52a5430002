"""The soak's request mix: what to send, and what each request must get back.

No transport here: ``soak.py`` sends the requests with aiohttp and ``locustfile.py`` with
Locust's client; both hand the answer (status, headers, and the body or the SSE ``data:``
payloads) to ``verify``.

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

import ipaddress
import itertools
import json
import random
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

WORDS = ("time person year way day thing world life hand part child eye woman place work week "
         "case point company number group problem fact river cache block token model layer "
         "batch queue stream paged kernel memory value key score light ocean stars city "
         "mountain book poem wind moon morning quick brown fox lazy dog").split()
MAX_TOKENS_CHOICES = (4, 8, 16)
NUM_PREFIXES = 4  # shared prefixes (prefix caching, prefix affinity)
NUM_PROMPTS = 24  # distinct prompts; each has a reference per (max_tokens, endpoint)
ERROR_KEYS = {"message", "type", "param", "code"}

# Kinds of valid requests and their weights in the mix.
VALID_KINDS = {"completion": 4, "completion_stream": 4, "chat": 3, "chat_stream": 3,
               "echo": 1, "multi": 1, "disconnect": 1}


@dataclass(frozen=True)
class Limits:
    """What the harness knows of the server's settings (``AppConfig``)."""

    model: str
    max_model_len: int
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    max_tokens_limit: int | None = None
    max_waiting_requests: int = 1024
    api_key: str | None = None


@dataclass
class Spec:
    """One HTTP request and what it must get back."""

    kind: str
    path: str
    body: bytes | None
    request_id: str
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    expect: int = 200
    stream: bool = False
    chunked: bool = False  # send the body without Content-Length
    disconnect_after: int | None = None  # SSE events to read before dropping the connection
    keys: list[tuple] = field(default_factory=list)  # reference key of each prompt
    n: int = 1
    max_tokens: int = 0
    echo: str | None = None  # the prompt the text must start with (echo=true)

    edge: bool = False  # valid but unusual input: it must be answered 200, content unchecked

    @property
    def bad(self) -> bool:
        return self.expect != 200 or self.edge


@dataclass
class Verdict:
    """``category``: completed, rejected, failed or disconnected; ``problems``: broken
    promises as (invariant, text); ``error_shaped``: the error answer was in OpenAI's shape."""

    category: str
    problems: list[tuple[str, str]] = field(default_factory=list)
    error_shaped: bool = True
    detail: str = ""
    sample: str = ""  # the start of an error answer


class References:
    """Greedy outputs per (endpoint, prompt, max_tokens): the first answer is the reference."""

    def __init__(self) -> None:
        self.texts: dict[tuple, str] = {}
        self.prompt_tokens: dict[tuple, int] = {}
        self.mismatches = 0

    def check_text(self, key: tuple, text: str) -> str | None:
        ref = self.texts.setdefault(key, text)
        if ref != text:
            self.mismatches += 1
            return f"{key}: got {text[:60]!r}, reference {ref[:60]!r}"
        return None

    def check_prompt_tokens(self, key: tuple, n: int) -> str | None:
        ref = self.prompt_tokens.setdefault(key, n)
        return None if ref == n else f"{key}: prompt_tokens {n}, reference {ref}"


class Mix:
    """Builds the requests of the soak from a seeded generator."""

    def __init__(self, limits: Limits, seed: int = 0, id_prefix: str = "soak") -> None:
        self.limits = limits
        self.rng = random.Random(seed)
        words = random.Random(1234)  # the prompt pool never depends on the run's seed
        self.prefixes = [" ".join(words.choice(WORDS) for _ in range(24))
                         for _ in range(NUM_PREFIXES)]
        self.suffixes = [" ".join(words.choice(WORDS) for _ in range(words.randint(2, 6)))
                         for _ in range(NUM_PROMPTS)]
        self._ids = itertools.count()
        self._id_prefix = id_prefix
        self.bad_cases = bad_cases(limits)

    # ---- valid requests --------------------------------------------------------------------

    def prompt(self, i: int) -> str:
        return f"{self.prefixes[i % NUM_PREFIXES]} {self.suffixes[i]}"

    def next_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.limits.api_key:
            h["Authorization"] = f"Bearer {self.limits.api_key}"
        return h

    def random_valid(self) -> Spec:
        kinds, weights = zip(*VALID_KINDS.items())
        return self.valid(self.rng.choices(kinds, weights)[0])

    def valid(self, kind: str) -> Spec:
        i = self.rng.randrange(NUM_PROMPTS)
        mt = self.rng.choice(MAX_TOKENS_CHOICES)
        common = {"model": self.limits.model, "temperature": 0, "ignore_eos": True}
        rid = self.next_id()
        if kind in ("chat", "chat_stream"):
            body = {**common, "max_completion_tokens": mt, "messages": [
                {"role": "system", "content": self.prefixes[i % NUM_PREFIXES]},
                {"role": "user", "content": self.suffixes[i]}]}
            key = ("chat", i, mt)
        else:
            body = {**common, "prompt": self.prompt(i), "max_tokens": mt}
            key = ("cmpl", i, mt)
        spec = Spec(kind, "/v1/chat/completions" if key[0] == "chat" else "/v1/completions",
                    None, rid, headers=self.headers(), keys=[key], max_tokens=mt)
        if kind.endswith("_stream") or kind == "disconnect":
            body["stream"] = spec.stream = True
            body["stream_options"] = {"include_usage": True}
        if kind == "echo":
            body["echo"] = True
            spec.echo = body["prompt"]
        elif kind == "multi":
            j = (i + 1 + self.rng.randrange(NUM_PROMPTS - 1)) % NUM_PROMPTS
            n = min(2, self.limits.max_n)
            body.update(prompt=[self.prompt(i), self.prompt(j)], n=n)
            spec.keys, spec.n = [key, ("cmpl", j, mt)], n
        elif kind == "disconnect":
            body["max_tokens"] = spec.max_tokens = self._long_tokens()
            spec.disconnect_after = self.rng.randint(1, 3)
        spec.body = json.dumps(body).encode()
        return spec

    def _long_tokens(self) -> int:
        cap = self.limits.max_tokens_limit or 128
        return max(16, min(cap, 96))

    def burst(self) -> Spec:
        spec = self.valid("completion")
        spec.kind = "burst"
        return spec

    def probe(self) -> Spec:
        """A short request that must succeed once the service has recovered from a fault."""
        spec = self.valid("completion")
        spec.kind = "probe"
        return spec

    # ---- bad requests ----------------------------------------------------------------------

    def random_bad(self) -> Spec:
        return self.bad(self.rng.choice(self.bad_cases))

    def bad(self, case: BadCase) -> Spec:
        headers = self.headers() if case.auth == "good" else {"Content-Type": "application/json"}
        if case.auth == "wrong":
            headers["Authorization"] = "Bearer wrong-key-" + "x" * 16
        elif case.auth == "basic":
            headers["Authorization"] = "Basic c29hazpzb2Fr"
        return Spec(f"{'edge' if case.status == 200 else 'bad'}:{case.name}", case.path,
                    case.body, self.next_id(), method=case.method, headers=headers,
                    expect=case.status, chunked=case.chunked, edge=case.status == 200)


@dataclass(frozen=True)
class BadCase:
    name: str
    body: bytes | None
    status: int
    path: str = "/v1/completions"
    method: str = "POST"
    auth: str = "good"  # good | none | wrong | basic
    chunked: bool = False


def bad_cases(limits: Limits) -> list[BadCase]:
    """Every kind of bad request the soak sends, with the status it must get."""
    def j(**kw: Any) -> bytes:
        return json.dumps({"model": limits.model, **kw}).encode()

    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    mml = limits.max_model_len
    cases = [
        BadCase("malformed_json", b'{"prompt": "hi", ', 400),
        BadCase("not_an_object", b'[1, 2, 3]', 400),
        BadCase("empty_body", b"", 400),
        BadCase("max_tokens_string", j(prompt="hi", max_tokens="7"), 400),
        BadCase("prompt_number", j(prompt=5), 400),
        BadCase("prompt_empty_list", j(prompt=[]), 400),
        BadCase("prompt_nested_empty", j(prompt=[[]]), 400),
        BadCase("prompt_negative_id", j(prompt=[-1]), 400),
        BadCase("prompt_id_outside_vocab", j(prompt=[10 ** 9]), 400),
        BadCase("prompt_id_huge", j(prompt=[2 ** 70]), 400),
        BadCase("messages_string", j(messages="hi"), 400, chat),
        BadCase("messages_empty", j(messages=[]), 400, chat),
        BadCase("role_unknown", j(messages=[{"role": "wizard", "content": "x"}]), 400, chat),
        BadCase("content_image", j(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400, chat),
        BadCase("stream_string", j(prompt="hi", stream="yes"), 400),
        BadCase("temperature_high", j(prompt="hi", temperature=5), 400),
        BadCase("temperature_nan", b'{"prompt": "hi", "temperature": NaN}', 400),
        BadCase("top_p_zero", j(prompt="hi", top_p=0), 400),
        BadCase("top_k_zero", j(prompt="hi", top_k=0), 400),
        BadCase("n_zero", j(prompt="hi", n=0), 400),
        BadCase("n_over_max", j(prompt="hi", n=limits.max_n + 1), 400),
        BadCase("max_tokens_negative", j(prompt="hi", max_tokens=-1), 400),
        BadCase("max_tokens_huge", j(prompt="hi", max_tokens=2 ** 40), 400),
        BadCase("min_tokens_over_max", j(prompt="hi", max_tokens=2, min_tokens=5), 400),
        BadCase("logprobs_over_max", j(prompt="hi", logprobs=50), 400),
        BadCase("top_logprobs_no_logprobs", j(messages=msgs, top_logprobs=2), 400, chat),
        BadCase("penalty_out_of_range", j(prompt="hi", presence_penalty=9), 400),
        BadCase("seed_huge", j(prompt="hi", seed=2 ** 70), 400),
        BadCase("stop_token_id_huge", j(prompt="hi", stop_token_ids=[2 ** 70]), 400),
        BadCase("stop_empty_string", j(prompt="hi", stop=[""]), 400),
        BadCase("stop_too_many", j(prompt="hi", stop=[str(k) for k in range(17)]), 400),
        BadCase("logit_bias", j(prompt="hi", logit_bias={"5": 10}), 400),
        BadCase("stream_options_without_stream", j(prompt="hi", stream_options={
            "include_usage": True}), 400),
        BadCase("echo_with_logprobs", j(prompt="hi", echo=True, logprobs=1), 400),
        BadCase("prompt_over_max_model_len", j(prompt=[5] * (mml + 8)), 400),
        BadCase("prompt_plus_max_tokens_over_len", j(prompt=[5] * (mml - 4), max_tokens=8), 400),
        BadCase("chat_over_max_model_len", j(messages=[
            {"role": "user", "content": "token " * (mml * 2)}]), 400, chat),
        BadCase("unknown_model", json.dumps({"model": "gpt-17", "prompt": "hi"}).encode(), 404),
        BadCase("body_over_limit", j(prompt="x" * (limits.max_body_bytes + 16)), 413),
        BadCase("body_over_limit_chunked", j(prompt="x" * (limits.max_body_bytes + 16)), 413,
                chunked=True),
        BadCase("unknown_route", j(prompt="hi"), 404, "/v1/engines/x/completions"),
        BadCase("wrong_method", None, 405, method="GET"),
        BadCase("deep_nesting", b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
        BadCase("lone_surrogate", b'{"prompt": "abc \\ud800 def"}', 400),
        BadCase("stop_token_id_outside_vocab", j(prompt="hi", max_tokens=4, min_tokens=2,
                                                 stop_token_ids=[10 ** 9]), 400),
        BadCase("too_many_prompts", j(prompt=["hi"] * (limits.max_waiting_requests + 1),
                                      max_tokens=1), 400),
        # valid but unusual: answered normally, never a 5xx
        BadCase("top_k_over_vocab", j(prompt="hi", max_tokens=2, top_k=10 ** 9), 200),
        BadCase("seed_negative", j(prompt="hi", max_tokens=2, temperature=1, seed=-5), 200),
        BadCase("seed_max", j(prompt="hi", max_tokens=2, temperature=1, seed=2 ** 63 - 1), 200),
        BadCase("unicode_prompt", j(prompt="h\u00e9llo \u4e16\u754c \U0001f600", max_tokens=2), 200),
        BadCase("extra_fields", j(prompt="hi", max_tokens=2, best_of=1, foo={"bar": 1}), 200),
        BadCase("stop_token_id_with_min_tokens", j(prompt="hi", max_tokens=4, min_tokens=2,
                                                   stop_token_ids=[3]), 200),
    ]
    if limits.max_tokens_limit is not None:
        cases.append(BadCase("max_tokens_over_limit",
                             j(prompt="hi", max_tokens=limits.max_tokens_limit + 1), 400))
    if limits.api_key:
        ok = j(prompt="hi", max_tokens=2)
        cases += [BadCase("no_api_key", ok, 401, auth="none"),
                  BadCase("wrong_api_key", ok, 401, auth="wrong"),
                  BadCase("basic_auth", ok, 401, auth="basic"),
                  BadCase("models_no_key", None, 401, "/v1/models", "GET", auth="none"),
                  BadCase("stats_no_key", None, 401, "/v1/stats", "GET", auth="none"),
                  BadCase("chat_wrong_key", j(messages=msgs), 401, chat, auth="wrong"),
                  BadCase("openapi_no_key", None, 404, "/openapi.json", "GET", auth="none"),
                  BadCase("docs_no_key", None, 404, "/docs", "GET", auth="none")]
    return cases


def require_loopback(url: str) -> None:
    """``SystemExit`` unless ``url`` names this machine (every address it resolves to is a
    loopback address): the soak and the Locust file are load generators, not network tools."""
    host = urlparse(url).hostname
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
    except socket.gaierror as e:
        raise SystemExit(f"{url}: cannot resolve {host!r} ({e}); use http://127.0.0.1:PORT") \
            from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"{url}: only this machine (loopback) may be loaded, but {host} is "
                         f"{sorted(addrs)}")


# ---- checking an answer ----------------------------------------------------------------------

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
