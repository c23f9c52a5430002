"""The soak's data types, shared by the mix, the checks, the report and the Locust file.

``Limits`` is what the harness knows of the server's settings, ``Spec`` one request and what it
must get back, ``Verdict`` the judgement of one answer and ``References`` the greedy outputs
each later answer to the same prompt must equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The invariants every answer is checked against, by the soak and by the Locust file alike.
REQUEST_INVARIANTS = ("no_hung", "belongs", "errors_openai_shape", "bad_input_4xx",
                      "overload_429", "no_unexpected_failures")


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

