"""Router deployment: the OpenAI HTTP front end and the dynamic batcher.

Per request: authorize, read the body (413 over ``max_request_body_bytes``), validate (400),
check the model name (404), tokenize and check the length (400), admit (429: ``admission``),
then queue one ``EngineRequest`` per prompt in the batcher and stream the Worker's tokens back as SSE or collect them into the final JSON. Leaving early (client gone,
stop string) aborts the request at the Worker replica that holds it.

No ``from __future__ import annotations``: FastAPI must see ``Request`` as a class through
``serve.ingress``'s method wrappers.
"""

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine import SamplingParams
from serve_app.config import AppConfig
from serve_app.metrics.router import RouterMetrics, install_http_metrics
from serve_app.protocol.errors import APIError, install_handlers
from serve_app.protocol.request_body import read_body
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest, parse_request
from serve_app.router.admission import Admission, Rejected
from serve_app.router.batch import EngineRequest
from serve_app.router.batcher import DynamicBatcher
from serve_app.router.demand import DemandReporter
from serve_app.router.endpoints import RouterEndpoints, routes, system_fingerprint
from serve_app.router.prompts import PromptProcessor
from serve_app.router.responses import SSE_DONE, ChatFormat, CompletionFormat, sse
from serve_app.router.streams import ResponseStream
from serve_app.router.worker_client import WorkerClient, sum_stats
from serve_app.wire import Part

logger = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-pagedserve-replica"
PREPARE_THREADS = 2  # threads that template and tokenize prompts, per Router replica

# No /docs, /redoc or /openapi.json: every route but /health sits behind the API key.
api = FastAPI(title="pagedserve", description="OpenAI-compatible LLM serving on Ray Serve.",
              docs_url=None, redoc_url=None, openapi_url=None)
install_handlers(api)
api.include_router(routes)  # /v1/models[/{id}], /tokenize, /detokenize, /version


# Module-level helpers go above the class: serve.ingress snapshots the module's globals when it
# wraps the class, so names defined below it are invisible to the routes.
def _response_id(prefix: str, request: Request) -> str:
    return f"{prefix}-{request.headers.get('x-request-id') or time.time_ns()}"


@serve.deployment(name="Router")
@serve.ingress(api)
class Router(RouterEndpoints):
    app: FastAPI  # the app Serve serves: set by serve.ingress's wrapper after __init__

    def __init__(self, worker: DeploymentHandle[Any], config: AppConfig) -> None:
        self.cfg = config
        key = config.resolved_api_key()
        self._api_key_digest = None if key is None else hashlib.sha256(key.encode()).digest()
        self.workers = WorkerClient(worker, grpc=config.serve_fast_path)
        self.metrics = RouterMetrics.for_replica(config)
        self.batcher = DynamicBatcher(self.metrics.count_batches(self.workers.run_batch),
                                      config.max_batch_size, config.batch_wait_ms / 1000.0)
        self.prompts: PromptProcessor | None = None
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS,
                                                thread_name_prefix="pagedserve-prepare")
        self._active: set[EngineRequest] = set()
        self._counters = {"requests_total": 0, "rejected_429_total": 0}
        self._ttft_ewma_s = 0.0
        self._health: tuple[float, bool] = (0.0, False)
        self._init_task = asyncio.get_running_loop().create_task(self._load_model_info())
        self._waking: asyncio.Task[None] | None = None  # brings a Worker up from zero replicas
        self.demand = DemandReporter(worker, self.workers.replicas, self._active).start()
        self.admission = Admission.for_router(config, self._active)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """This replica's app (Serve's copy of ``api``), its HTTP responses counted into
        ``self.metrics``. Serve (2.60) calls it once the replica is built, before the app
        starts."""
        app: FastAPI = self.app
        install_http_metrics(app, self.metrics)
        return app

    async def _load_model_info(self) -> None:
        """Fetch the tokenizer and limits from a Worker, retrying until one is up."""
        while True:
            try:
                info = await asyncio.wait_for(self.workers.model_info(), timeout=10.0)
                self.prompts = p = PromptProcessor.for_app(info, self.cfg)
                logger.info("serving %s (dtype %s, weights %s, KV cache %s, max_model_len %d, "
                            "vocab_size %d)", p.model_name, p.dtype, p.quantization or p.dtype,
                            p.kv_cache_dtype or p.dtype, p.max_model_len, p.vocab_size)
                return
            except Exception as exc:  # no Worker yet, or it is still loading its model
                logger.info("waiting for a Worker to report its model: %r", exc)
                await asyncio.sleep(1.0)

    # ---- routes ----------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> JSONResponse:
        if not await self._healthy():
            raise APIError(503, "no Worker has its model loaded")
        return JSONResponse({"status": "ok"})

    @api.get("/v1/stats")
    async def stats(self, request: Request) -> JSONResponse:
        """Router counters and every Worker replica's engine stats (with their sum)."""
        self._authorize(request)
        workers = await self.workers.stats()
        router = {**self._counters, "num_waiting": self.admission.num_waiting(),
                  "num_active": len(self._active),
                  "batch_sizes": {str(k): v for k, v in sorted(self.batcher.batch_sizes.items())}}
        return JSONResponse({"router": router, "workers": workers, "total": sum_stats(workers)})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        arrived = time.monotonic()  # time to first token counts from here, as vLLM's does
        self._authorize(request)
        req: CompletionRequest = parse_request(CompletionRequest, await self._body(request))
        p = await self._ready(shed=True)
        p.check_model(req.model)
        p.check_size(len(req.prompts()), req.n, req.max_tokens, req.max_tokens_param)
        prompts, params, echo = await self._off_loop(p.prepare_completion, req)
        fmt = CompletionFormat(_response_id("cmpl", request), p.model_name, p.tokenizer,
                               len(prompts) * req.n, system_fingerprint(p), n=req.n,
                               want_logprobs=req.logprobs is not None, echo_texts=echo,
                               echo_logprobs=req.logprobs if req.echo else None,
                               prompt_logprobs=req.prompt_logprobs is not None,
                               prompt_token_ids=prompts if req.return_token_ids else None)
        fmt.tokens_as_ids = req.return_tokens_as_token_ids
        return await self._run(p, req, prompts, params, fmt, req.logprobs, arrived)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        arrived = time.monotonic()
        self._authorize(request)
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest,
                                                   await self._body(request))
        p = await self._ready(shed=True)
        p.check_model(req.model)
        p.check_size(1, req.n, req.completion_limit(), req.max_tokens_param)
        ids, params, tools = await self._off_loop(p.prepare_chat, req)
        fmt = ChatFormat(_response_id("chatcmpl", request), p.model_name, p.tokenizer, req.n,
                         system_fingerprint(p), want_logprobs=req.logprobs, tools=tools,
                         prompt_logprobs=req.prompt_logprobs is not None,
                         prompt_token_ids=[ids] if req.return_token_ids else None)
        fmt.tokens_as_ids = req.return_tokens_as_token_ids
        return await self._run(p, req, [ids], params, fmt, req.num_logprobs(), arrived)

    # ---- request flow ----------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run prompt preparation (templating, tokenizing: CPU work as long as the prompt) in
        the Router's small thread pool, so that the streams on this event loop keep flowing."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)

    async def _run(self, p: PromptProcessor, req: Any, prompts: list[list[int]],
                   params: list[SamplingParams], fmt: Any, num_logprobs: int | None,
                   arrived: float) -> Any:
        """Admit, queue one engine request per prompt, and answer with SSE or JSON."""
        self._admit(len(prompts) * req.n)
        self.demand.accepted(len(prompts) * req.n, sum(map(len, prompts)))
        events: asyncio.Queue[tuple[EngineRequest, Part]] = asyncio.Queue()  # shared by its prompts
        engine_reqs = [EngineRequest(ids, sp, p.prefix_hashes(ids), events=events,
                                     arrived_at=arrived)
                       for ids, sp in zip(prompts, params, strict=True)]
        self._active.update(engine_reqs)
        self.batcher.submit(*engine_reqs)
        stream = ResponseStream(engine_reqs, p.tokenizer, req.stop_list(),
                                req.include_stop_str_in_output, req.skip_special_tokens,
                                num_logprobs, self.workers.release)
        try:
            await engine_reqs[0].routed.wait()
            headers = {REPLICA_HEADER: engine_reqs[0].replica or ""}
            if req.stream:
                body = self._sse(req, stream, fmt, engine_reqs)
                return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        except BaseException:
            self._finish(engine_reqs)
            raise
        try:
            async for deltas in stream.deltas():
                fmt.collect(deltas)
            return JSONResponse(fmt.final(stream.usage, stream.prompt_logprobs), headers=headers)
        finally:
            self._finish(engine_reqs)

    async def _sse(self, req: Any, stream: ResponseStream, fmt: Any,
                   engine_reqs: list[EngineRequest]) -> Any:
        def sse_chunk(chunk: dict[str, Any]) -> str:  # vLLM's continuous_usage_stats
            return sse({**chunk, "usage": stream.usage.as_dict()} if req.usage_in_every_chunk
                       else chunk)

        try:
            if isinstance(fmt, ChatFormat):
                yield sse_chunk(fmt.role_chunk(len(engine_reqs) * req.n))
            async for deltas in stream.deltas():
                for chunk in fmt.stream_chunks(deltas):
                    yield sse_chunk(chunk)
            if req.include_usage:
                yield sse(fmt.usage_chunk(stream.usage))
            yield SSE_DONE
        except APIError as exc:
            yield sse(exc.body())
            yield SSE_DONE
        finally:
            self._finish(engine_reqs)

    def _finish(self, engine_reqs: list[EngineRequest]) -> None:
        for r in engine_reqs:
            if r in self._active:
                self._active.discard(r)
                if r.first_output_at is not None:  # for admission; the metric from arrival
                    ttft = r.first_output_at - r.submitted_at
                    self._ttft_ewma_s = 0.9 * self._ttft_ewma_s + 0.1 * ttft
                    self.metrics.first_token(r.first_output_at - r.arrived_at)
                self.batcher.discard(r)
                self.workers.release(r)

    # ---- checks ----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._api_key_digest is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        # equal-length digests: the comparison's time says nothing about the key
        digest = hashlib.sha256(token.encode()).digest()
        if not hmac.compare_digest(digest, self._api_key_digest):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.cfg.max_request_body_bytes)

    async def _ready(self, shed: bool = False) -> PromptProcessor:
        if self.cfg.scales_to_zero() and (self.prompts is None or not self.workers.replicas()):
            if shed:  # a request to admit: 429 if holding it for a Worker to start would not do
                self._admit(None)
            await self._wait_for_worker()
        if self.prompts is None:
            raise APIError(503, "no Worker has loaded the model yet; retry shortly",
                           headers={"Retry-After": "1"})
        if not self.workers.replicas():
            raise APIError(503, "no healthy Worker replica", headers={"Retry-After": "1"})
        return self.prompts

    async def _wait_for_worker(self) -> None:
        """Hold requests while the Workers are scaled to zero, up to ``cold_start_timeout_s``.

        A handle call queued for a deployment with no replica makes Serve start one at once
        (its cold-start path); the call ends when that replica answers. Requests that arrive
        meanwhile share the wait. After a timeout, ``_ready`` answers 503.
        """
        if self._waking is None or self._waking.done():
            self._waking = asyncio.get_running_loop().create_task(
                asyncio.wait_for(self._wake_worker(), self.cfg.cold_start_timeout_s))
        try:
            await asyncio.shield(self._waking)
        except Exception as exc:  # timed out, or the Worker failed to start
            logger.warning("no Worker came up for a held request: %r", exc)

    async def _wake_worker(self) -> None:
        while self.prompts is None or not self.workers.replicas():
            if self.prompts is None:
                await asyncio.shield(self._init_task)
            else:
                await self.workers.model_info()  # queued until a Worker replica runs
                await asyncio.sleep(0.05)

    async def _healthy(self) -> bool:
        checked_at, ok = self._health
        if time.monotonic() - checked_at < 1.0:
            return ok
        ok = self.prompts is not None and bool(await self.workers.stats(timeout_s=2.0))
        if self.prompts is not None and self.cfg.scales_to_zero() and not self.workers.replicas():
            ok = True  # scaled to zero on purpose: the next request starts a Worker
        self._health = (time.monotonic(), ok)
        return ok

    def _admit(self, num_seqs: int | None) -> None:
        """429 unless ``num_seqs`` more sequences pass admission (None: to hold for a Worker)."""
        self._counters["requests_total"] += num_seqs is not None
        try:
            self.admission.admit(num_seqs, self._ttft_ewma_s)
        except Rejected as exc:
            self._counters["requests_total"] += num_seqs is None  # it ends here, before _run
            self._counters["rejected_429_total"] += 1
            self.metrics.rejected(exc.cause)
            raise
