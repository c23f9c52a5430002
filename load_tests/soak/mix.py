"""The soak's request mix: what to send, from a seeded generator.

No transport here: ``runner.py`` sends the requests with aiohttp and ``locustfile.py`` with
Locust's client; both hand the answer (status, headers, and the body or the SSE ``data:``
payloads) to ``verify.verify``. The prompts come from a fixed pool with shared prefixes and
every valid request is greedy, so each answer can be held to the reference recorded for its
prompt.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import random
import socket
from urllib.parse import urlparse

from .cases import BadCase, bad_cases
from .spec import Limits, Spec

WORDS = ("time person year way day thing world life hand part child eye woman place work week "
         "case point company number group problem fact river cache block token model layer "
         "batch queue stream paged kernel memory value key score light ocean stars city "
         "mountain book poem wind moon morning quick brown fox lazy dog").split()
MAX_TOKENS_CHOICES = (4, 8, 16)
NUM_PREFIXES = 4  # shared prefixes (prefix caching, prefix affinity)
NUM_PROMPTS = 24  # distinct prompts; each has a reference per (max_tokens, endpoint)

# Kinds of valid requests and their weights in the mix.
VALID_KINDS = {"completion": 4, "completion_stream": 4, "chat": 3, "chat_stream": 3,
               "echo": 1, "multi": 1, "disconnect": 1}


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

