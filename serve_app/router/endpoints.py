"""The Router's smaller routes, as vLLM's server has them: ``/v1/models`` and one model by id,
``/tokenize``, ``/detokenize`` and ``/version``; and the ``system_fingerprint`` of responses.

The routes are methods of ``RouterEndpoints``, a base class of the ``Router`` deployment,
registered on ``routes`` (an ``APIRouter`` that ``serve_app/router/router.py`` includes into its
app): Serve binds a route's ``self`` to the replica when the method's class is in the
deployment's MRO. Like the Router's own routes, each checks the API key first (401), reads the
body under ``max_request_body_bytes`` (413), and answers errors in OpenAI's shape (the app's
handlers, ``serve_app.protocol.errors``).

No ``from __future__ import annotations``: FastAPI must see ``Request`` as a class.
"""

import hashlib
from collections.abc import Callable
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError, model_validator

from serve_app.protocol.chat_template import ChatMessage
from serve_app.protocol.errors import APIError, FieldError, StrictModel, from_validation_error
from serve_app.protocol.requests import TokenIds
from serve_app.protocol.tools import Tool
from serve_app.router.prompts import PromptProcessor

routes = APIRouter()
T = TypeVar("T")
P = ParamSpec("P")


@cache
def pagedserve_version() -> str:
    """The installed package's version ("unknown" when run from a checkout not installed)."""
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:
        return "unknown"


@cache
def _fingerprint(*parts: str | None) -> str:
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return f"fp_{digest[:10]}"


def system_fingerprint(p: PromptProcessor) -> str:
    """OpenAI's ``system_fingerprint``: one string per deployment configuration (pagedserve's
    version, the served model, its dtype, weight format and KV-cache format): it changes when
    any of what decides the tokens does."""
    return _fingerprint(pagedserve_version(), p.model_name, p.dtype, p.quantization,
                        p.kv_cache_dtype)


def model_card(p: PromptProcessor) -> dict[str, Any]:
    """The served model as ``/v1/models`` lists it (OpenAI's fields, then the engine's)."""
    return {"id": p.model_name, "object": "model", "created": 0, "owned_by": "pagedserve",
            "max_model_len": p.max_model_len, "dtype": p.dtype,
            "quantization": p.quantization, "kv_cache_dtype": p.kv_cache_dtype}


class TokenizeRequest(StrictModel):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` through the chat template
    (exactly as ``/v1/chat/completions`` renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = Field(
        None, description="Default: true with a prompt; with messages the template places them "
        "(only false).")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt and messages")
        if self.messages is not None and self.add_special_tokens:
            raise FieldError("add_special_tokens", "must be false with messages (the chat "
                             "template places the special tokens)")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "needs add_generation_prompt=false")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: TokenIds


M = TypeVar("M", bound=StrictModel)


def _parse(cls: type[M], body: bytes) -> M:
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _tokenize(p: PromptProcessor, req: TokenizeRequest) -> dict[str, Any]:
    """Token ids as a completion or chat request with this input would send them (400 past
    ``max_model_len``, as there)."""
    if req.messages is None:
        ids = p.encode(req.prompt or "", add_special_tokens=req.add_special_tokens is not False)
    else:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = p.encode_chat([m.template_dict() for m in req.messages],
                            req.add_generation_prompt, tools, req.continue_final_message,
                            req.chat_template_kwargs)
    strs = p.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": p.max_model_len, "tokens": ids,
            "token_strs": strs}


def _detokenize(p: PromptProcessor, tokens: list[int]) -> dict[str, Any]:
    if tokens and max(tokens) >= p.vocab_size:
        raise APIError(400, f"tokens: token id {max(tokens)} is outside the vocabulary "
                       f"[0, {p.vocab_size})", param="tokens")
    return {"prompt": p.tokenizer.decode(tokens)}


class _RouterMethods(Protocol):
    """What the routes use of the Router (serve_app/router/router.py)."""

    def _authorize(self, request: Request) -> None: ...

    async def _body(self, request: Request) -> bytes: ...

    async def _ready(self) -> PromptProcessor: ...

    async def _off_loop(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T: ...


if TYPE_CHECKING:  # for mypy only: FastAPI would take an annotated ``self`` for a parameter
    _Base = _RouterMethods
else:
    _Base = object


class RouterEndpoints(_Base):
    """The routes above, as methods of the Router deployment (its base class)."""

    @routes.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        p = await self._ready()
        return JSONResponse({"object": "list", "data": [model_card(p)]})

    @routes.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        """One model by id (OpenAI's ``models.retrieve``); another id is a 404
        ``model_not_found``."""
        self._authorize(request)
        p = await self._ready()
        p.check_model(model_id)
        return JSONResponse(model_card(p))

    @routes.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        self._authorize(request)
        req: TokenizeRequest = _parse(TokenizeRequest, await self._body(request))
        p = await self._ready()
        p.check_model(req.model)
        return JSONResponse(await self._off_loop(_tokenize, p, req))

    @routes.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        self._authorize(request)
        req: DetokenizeRequest = _parse(DetokenizeRequest, await self._body(request))
        p = await self._ready()
        p.check_model(req.model)
        return JSONResponse(await self._off_loop(_detokenize, p, req.tokens))

    @routes.get("/version")
    async def version(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"version": pagedserve_version()})
