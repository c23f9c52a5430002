"""Router deployment: the OpenAI HTTP front end and the dynamic batcher.

Per request: authorize, read the body (413 over ``max_request_body_bytes``), validate (400),
check the model name (404), tokenize and check the length into a ``PreparedRequest`` (400:
``serve_app/router/prompts.py``, where its ``SamplingParams`` are built once), admit (429:
``admission``), then queue one ``EngineRequest`` per prompt in the batcher and stream the
Worker's tokens back as SSE or collect them into the final JSON (``serve_app/router/answer.py``).
Leaving early (client gone, stop string) aborts the request at the Worker replica that holds it.

No ``from __future__ import annotations``: FastAPI must see ``Request`` as a class through
``serve.ingress``'s method wrappers.
"""

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ParamSpec, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.metrics.router import RouterMetrics, install_http_metrics
from serve_app.protocol.errors import APIError, install_handlers
from serve_app.protocol.request_body import read_body
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest, parse_request
from serve_app.router.admission import Admission, Rejected
from serve_app.router.answer import formatter, sse_body
from serve_app.router.batch import EngineRequest
from serve_app.router.batcher import DynamicBatcher
from serve_app.router.demand import DemandReporter
from serve_app.router.endpoints import RouterEndpoints, routes, system_fingerprint
from serve_app.router.prepared import PreparedRequest
from serve_app.router.prompts import PromptProcessor
from serve_app.router.readiness import WorkerReadiness
from serve_app.router.streams import ResponseStream
from serve_app.router.worker_client import WorkerClient, sum_stats
from serve_app.wire import Part

REPLICA_HEADER = "x-pagedserve-replica"
PREPARE_THREADS = 2  # threads that template and tokenize prompts, per Router replica
T = TypeVar("T")
P = ParamSpec("P")

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
class Router(RouterEndpoints, WorkerReadiness):
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
    async def completions(self, request: Request) -> Response:
        arrived = time.monotonic()  # time to first token counts from here, as vLLM's does
        self._authorize(request)
        req = parse_request(CompletionRequest, await self._body(request))
        p = await self._ready(shed=True)
        p.check_model(req.model)
        p.check_size(len(req.prompts()), req.n, req.max_tokens, req.max_tokens_param)
        prep = await self._off_loop(p.prepare_completion, req)
        return await self._run(p, prep, _response_id("cmpl", request), arrived)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        self._authorize(request)
        req = parse_request(ChatCompletionRequest, await self._body(request))
        p = await self._ready(shed=True)
        p.check_model(req.model)
        p.check_size(1, req.n, req.completion_limit(), req.max_tokens_param)
        prep = await self._off_loop(p.prepare_chat, req)
        return await self._run(p, prep, _response_id("chatcmpl", request), arrived)

    # ---- request flow ----------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run prompt preparation (templating, tokenizing: CPU work as long as the prompt) in
        the Router's small thread pool, so that the streams on this event loop keep flowing."""
        return await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, partial(fn, *args, **kwargs))

    async def _run(self, p: PromptProcessor, prep: PreparedRequest, response_id: str,
                   arrived: float) -> Response:
        """Admit, queue one engine request per prompt, and answer with SSE or JSON."""
        self._admit(prep.num_seqs)
        self.demand.accepted(prep.num_seqs, sum(map(len, prep.prompts)))
        events: asyncio.Queue[tuple[EngineRequest, Part]] = asyncio.Queue()  # shared by its prompts
        engine_reqs = [EngineRequest(ids, sp, p.prefix_hashes(ids), events=events,
                                     arrived_at=arrived)
                       for ids, sp in zip(prep.prompts, prep.params, strict=True)]
        self._active.update(engine_reqs)
        self.batcher.submit(*engine_reqs)
        out = prep.output
        stream = ResponseStream(engine_reqs, p.tokenizer, out.stop, out.include_stop_str_in_output,
                                out.skip_special_tokens, out.num_logprobs, self.workers.release)
        fmt = formatter(prep, response_id, p.model_name, p.tokenizer, system_fingerprint(p))
        try:
            await engine_reqs[0].routed.wait()
            headers = {REPLICA_HEADER: engine_reqs[0].replica or ""}
            if out.stream:
                body = sse_body(prep, stream, fmt, lambda: self._finish(engine_reqs))
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
