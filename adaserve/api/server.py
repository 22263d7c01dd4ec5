"""The FastAPI app and its uvicorn server.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize (these need the API key when one is set), GET /health, GET /version,
GET /metrics. `build_app` wires one LLMEngine into an app; `serve` runs it with uvicorn and
shuts down gracefully: on SIGINT/SIGTERM new requests get 503, running ones may finish for
`shutdown_timeout_s`, the rest are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adaserve import __version__
from adaserve.api.async_engine import AsyncEngine, EngineFront
from adaserve.api.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    internal_error_handler,
)
from adaserve.api.logs import StatsLogger
from adaserve.api.metrics import ServerMetrics
from adaserve.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from adaserve.api.serving import REQUEST_ID_HEADER, SLO_HEADERS, OpenAIServing
from adaserve.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    Tokenization,
    TokenizeRequest,
    TokenizeResponse,
)
from adaserve.config import ServerConfig
from adaserve.heap import freeze_startup_heap
from adaserve.llm import LLMEngine

logger = logging.getLogger("adaserve.api")


def served_model_name(engine: LLMEngine, cfg: ServerConfig) -> str:
    """--served-model-name, else the model as given on the command line (as vLLM names it)."""
    if cfg.served_model_name:
        return cfg.served_model_name
    return engine.model_cfg.model or engine.engine.target_path.name


@dataclass(frozen=True)
class ModelInfo:
    """What the routes say about the engine behind them (/v1/models, /health)."""

    name: str
    max_model_len: int
    root: str
    policy: str
    budget: int
    budget_ceiling: int  # what policy adaserve may verify per forward (B for the others)
    drafter: str
    backend: str
    max_waiting: int | None


def model_info(engine: LLMEngine, cfg: ServerConfig) -> ModelInfo:
    drafter = engine.scheduler.drafter
    return ModelInfo(
        name=served_model_name(engine, cfg),
        max_model_len=engine.max_model_len,
        root=str(engine.engine.target_path),
        policy=engine.sched_cfg.policy,
        budget=engine.sched_cfg.budget,
        budget_ceiling=engine.scheduler.cfg.selection_budget,
        drafter=drafter.name if drafter is not None else "none",
        backend=getattr(engine.engine, "backend", "torch"),
        max_waiting=engine.sched_cfg.max_waiting,
    )


def build_app(engine: LLMEngine, cfg: ServerConfig) -> FastAPI:
    """An app serving `engine`; the engine thread starts and stops with the app's lifespan."""
    info = model_info(engine, cfg)
    metrics = ServerMetrics(cfg.slo_classes, model_name=info.name, vllm_aliases=cfg.vllm_metrics)
    metrics.drafter_info.labels(info.policy, info.drafter).set(1)
    metrics.backend_info.labels(info.backend).set(1)
    return make_app(AsyncEngine(engine, metrics, cfg.admission), info, cfg, metrics.render)


def make_app(
    front: EngineFront,
    info: ModelInfo,
    cfg: ServerConfig,
    render_metrics: Callable[[], bytes | Awaitable[bytes]],
) -> FastAPI:
    """The OpenAI routes over an engine front: the engine thread of this process
    (`AsyncEngine`), or replicas on Ray Serve (`adaserve.cluster.ray_serve`)."""
    name = info.name
    metrics = front.metrics
    serving = OpenAIServing(front, cfg, name, info.max_waiting)
    tokenization = Tokenization(front, name, info.max_model_len)
    created = int(time.time())

    stats_logger = None
    if cfg.log_stats_interval_s > 0:
        stats_logger = StatsLogger(render_metrics, cfg.log_stats_interval_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        front.start()
        stats = None if stats_logger is None else asyncio.create_task(stats_logger.run())
        yield
        serving.draining = True
        if stats is not None:
            stats.cancel()
        await front.shutdown()

    app = FastAPI(title="adaserve", version=__version__, lifespan=lifespan)
    app.state.serving, app.state.metrics, app.state.async_engine = serving, metrics, front
    app.state.stats_logger = stats_logger
    app.add_middleware(EchoRequestId)
    if cfg.allowed_origins:  # added last: outermost, so preflights never reach auth
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cfg.allowed_origins),
            allow_methods=list(cfg.allowed_methods),
            allow_headers=list(cfg.allowed_headers),
            # What a browser script may read of a response besides the simple headers.
            expose_headers=["X-Request-Id", "Retry-After", "X-SLO-Admission"],
        )
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)

    keys = [k.encode() for k in cfg.api_keys]

    async def check_api_key(request: Request) -> None:
        if not keys:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        sent = token.strip().encode()
        # Compare against every key, each in constant time: neither which key nor how much
        # of one matched shows in the response time.
        matches = [hmac.compare_digest(sent, k) for k in keys]
        if scheme.lower() != "bearer" or not any(matches):
            metrics.reject("unauthorized")
            raise APIError(
                401,
                "missing or wrong API key; send the header 'Authorization: "
                "Bearer <key>' with a key the server was started with",
                code="invalid_api_key",
            )

    auth = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=name, created=created, max_model_len=info.max_model_len, root=info.root
                )
            ]
        )

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> TokenizeResponse:
        return await tokenization.tokenize(request)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await tokenization.detokenize(request)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if serving.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not front.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "policy": info.policy,
                "budget": info.budget,
                "budget_ceiling": info.budget_ceiling,
                "drafter": info.drafter,
            }
        )

    @app.get("/metrics", dependencies=auth if cfg.protect_metrics else [])
    async def prometheus_metrics() -> Response:
        text = render_metrics()
        if inspect.isawaitable(text):  # replicas' metrics gathered over the network
            text = await text
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    describe_api(app)
    return app


# (path, request model, response model, streams) of the routes that read their body
# themselves (to answer in OpenAI's error format); their schemas go into the OpenAPI document
# by hand.
_BODIES = (
    ("/v1/completions", CompletionRequest, CompletionResponse, True),
    ("/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse, True),
    ("/tokenize", TokenizeRequest, TokenizeResponse, False),
    ("/detokenize", DetokenizeRequest, DetokenizeResponse, False),
)
_ERRORS = {
    "400": "invalid request: the message names the field (`param`) to fix",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "429": "queue full: retry after the `Retry-After` header's seconds",
    "503": "draining or engine stopped: retry after `Retry-After`",
}


class EchoRequestId:
    """Every response to a request that carried X-Request-Id carries it back, errors
    included; a generation response without one carries the server's id (serving.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = REQUEST_ID_HEADER.encode()
        sent = None
        if scope["type"] == "http":
            sent = next((v for k, v in scope["headers"] if k == key), None)
        if sent is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == key for k, _ in headers):
                    message = {**message, "headers": [*headers, (key, sent)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def describe_api(app: FastAPI) -> None:
    """Publish the request and response bodies of the body-reading routes in /openapi.json."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})

        def ref(model: type) -> dict:
            s = model.model_json_schema(ref_template="#/components/schemas/{model}")  # type: ignore[attr-defined]
            comps.update(s.pop("$defs", {}))
            comps[model.__name__] = s
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        error = ref(ErrorResponse)
        for path, request, response, streams in _BODIES:
            op = schema["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref(request)}},
            }
            content = {"application/json": {"schema": ref(response)}}
            if streams:
                content["text/event-stream"] = {"schema": {"type": "string"}}
                op["parameters"] = [
                    {
                        "name": header,
                        "in": "header",
                        "required": False,
                        "schema": {"type": "number", "exclusiveMinimum": 0},
                        "description": f"adaserve: {field} as a header (the body field wins), "
                        "for gateways that set SLOs per route or tenant",
                    }
                    for header, field in SLO_HEADERS.items()
                ]
            op["responses"] = {
                "200": {
                    "description": "the answer; with `stream: true` server-sent events of "
                    "chunks, then `data: [DONE]`"
                    if streams
                    else "the answer",
                    "content": content,
                },
                **{
                    code: {"description": text, "content": {"application/json": {"schema": error}}}
                    for code, text in _ERRORS.items()
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class _GracefulServer(uvicorn.Server):
    """uvicorn, plus a drain: the moment a shutdown signal arrives, new requests get 503 and
    /health says "draining", while the socket stays open; uvicorn's own shutdown (stop
    listening, wait for connections) starts only once every running request has ended, or
    at once on a second signal."""

    def __init__(
        self, config: uvicorn.Config, serving: OpenAIServing, drain_timeout_s: float | None
    ) -> None:
        super().__init__(config)
        self.serving = serving
        self.drain_timeout_s = drain_timeout_s
        self._drain_timer: threading.Timer | None = None
        self._drain_watch: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_watch is not None:  # a second signal: stop waiting for the drain
            super().handle_exit(sig, frame)
            return
        self.serving.draining = True
        if self.drain_timeout_s is not None:
            # At the end of the grace period every running request is finished with reason
            # "abort", so its client gets a final chunk instead of a cut connection.
            self._drain_timer = threading.Timer(self.drain_timeout_s, self.serving.engine.abort_all)
            self._drain_timer.daemon = True
            self._drain_timer.start()
        self._drain_watch = threading.Thread(
            target=self._exit_when_drained, args=(sig,), name="adaserve-drain", daemon=True
        )
        self._drain_watch.start()

    def _exit_when_drained(self, sig: int) -> None:
        # Closing the socket at once would turn the drain's 503 + Retry-After (which a load
        # balancer retries elsewhere) into connection-refused for as long as requests run.
        # Every open request ends: it finishes, the drain timeout aborts it, or a dead engine
        # fails it; each end is marked on the event loop, the last one sets `idle`.
        self.serving.engine.idle.wait()
        super().handle_exit(sig, None)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn re-raises the SIGTERM/SIGINT it shut down for once it is done, which kills
        the process before `serve`'s caller runs: the acceptance log and the refined cost
        model were never written. The shutdown was graceful: return normally (exit 0)."""
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:
                captured.clear()


def make_server(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    shutdown_timeout_s: float | None = None,
) -> uvicorn.Server:
    """A uvicorn server for `app` (run with `.run()`, or `.serve()` inside a loop)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # uvicorn cuts connections only after the drain has aborted what still ran and the
        # final chunks went out.
        # (uvicorn annotates an int but hands it to asyncio.wait_for, which takes a float.)
        timeout_graceful_shutdown=None if shutdown_timeout_s is None else shutdown_timeout_s + 5,  # type: ignore[arg-type]
        # Our own access line per finished request (logs.py) replaces uvicorn's per response.
        access_log=False,
        # uvicorn's lines go to the root logger, formatted (timestamps) like every other line.
        log_config=None,
    )
    return _GracefulServer(config, app.state.serving, shutdown_timeout_s)


def serve(
    engine: LLMEngine,
    cfg: ServerConfig,
    log_level: str = "info",
    shutdown_timeout_s: float | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = build_app(engine, cfg)
    # The model, the tokenizer and the app live until the process exits: full collector
    # passes over them stalled every stream for 0.2 s (heap.py).
    freeze_startup_heap()
    logger.info(
        "serving %s on http://%s:%d (policy %s)",
        served_model_name(engine, cfg),
        cfg.host,
        cfg.port,
        engine.sched_cfg.policy,
    )
    make_server(app, cfg.host, cfg.port, log_level, shutdown_timeout_s).run()
