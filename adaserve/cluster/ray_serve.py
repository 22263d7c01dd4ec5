"""Scale-out on Ray Serve: `adaserve serve --replicas N` (the `cluster` extra).

One Ray Serve application:

- `EngineReplica` x N: each the engine `adaserve serve` runs alone (its own KV cache,
  scheduler, cost model and admission), behind its own `AsyncEngine` thread. `generate`
  streams a request's items (Accepted / Refused / Rejected / Delta, the single server's
  stream) back through the deployment handle; `record_routing_stats` publishes what the
  SLO router ranks by (`adaserve.cluster.router.replica_stats`: predicted TPOT of one more
  request, its slope, the tightest SLO held, the prompt backlog) and hands the replica's
  Prometheus text to the `MetricsBoard`.
- `Ingress`: the single server's FastAPI app (`make_app`) over a `RemoteEngine`, which sends
  each request to the engine deployment and turns the stream back into the same HTTP answers
  (429 + Retry-After when the replica's admission refuses, 503 when no replica took it).
- `SLORequestRouter`: Ray Serve's `RequestRouter` API with the ranking of `Router("slo")`:
  replicas that can meet the request's `slo_tpot_ms` first, tight requests where the
  predicted TPOT is lowest, loose ones away from tighter requests and onto the fewest. Stats
  are a period old: between refreshes the router reserves each request it sent on its
  replica. When no replica is feasible it sends the request to the one with the shortest
  backlog, whose own admission (`--admission slo`, the default) answers 429: the cluster
  refuses only what its best replica cannot take.
- `/metrics`: every replica's families with a `replica` label (the ingress's own, e.g. its
  refusals of bad requests, as `replica="ingress"`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, fields
from typing import Any, cast

import ray
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from adaserve.api.async_engine import (
    ENGINE_STOPPED,
    AsyncEngine,
    EngineFailed,
    Rejected,
    RequestStream,
    StreamBook,
    StreamItem,
    Tokenize,
    ends_stream,
)
from adaserve.api.logs import configure_logging
from adaserve.api.metrics import ServerMetrics
from adaserve.api.server import ModelInfo, make_app, model_info
from adaserve.cluster.router import ReplicaStats, Router, replica_stats
from adaserve.config import SchedulerConfig, ServerConfig
from adaserve.heap import freeze_startup_heap
from adaserve.request_manager.request import SamplingParams
from adaserve.request_manager.structured import StructuredOutput

logger = logging.getLogger("adaserve.cluster")

APP_NAME = "adaserve"
ENGINE_DEPLOYMENT = "adaserve-engine"
# How often Serve's controller asks each replica for its routing stats (and metrics).
STATS_PERIOD_S = 0.5
# What the ingress's own registry adds to /metrics: the requests it refused itself.
INGRESS_SAMPLES = ("adaserve_requests_rejected_total",)
# A replica's stats snapshot is taken on its engine thread at most this often.
SNAPSHOT_PERIOD_S = 0.1


class EngineReplica:
    """One engine, as `adaserve serve` runs it, serving the ingress through a handle."""

    def __init__(self, args: argparse.Namespace, cfg: ServerConfig, board: ray.actor.ActorHandle):
        from adaserve.cli import build_engine

        configure_logging(args.log_level)
        self.engine, _ = build_engine(args)
        self.model = model_info(self.engine, cfg)
        metrics = ServerMetrics(
            cfg.slo_classes, model_name=self.model.name, vllm_aliases=cfg.vllm_metrics
        )
        metrics.drafter_info.labels(self.model.policy, self.model.drafter).set(1)
        metrics.backend_info.labels(self.model.backend).set(1)
        self.front = AsyncEngine(self.engine, metrics, cfg.admission)
        self.board = board
        self.name = serve.get_replica_context().replica_id.unique_id
        self._stats = ReplicaStats(0, 0.0, 0.0)
        self._stats_at = 0.0
        self.front.on_state = self._snapshot  # the scheduler is read on its own thread only
        freeze_startup_heap()  # the replica's actor serves until it exits (heap.py)
        self.front.start()

    def _snapshot(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= SNAPSHOT_PERIOD_S:
            self._stats, self._stats_at = replica_stats(self.engine.admission), now

    def info(self) -> ModelInfo:
        return self.model

    async def generate(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | list[int] | None,
        messages: list[dict] | None,
        fill_max_tokens: bool,
        waited_s: float,
        add_special_tokens: bool | None = None,
        slo_tpot_ms: float | None = None,  # read by the router, not here
    ) -> AsyncIterator[StreamItem]:
        """The request's stream; cancelled by the ingress (client gone), its KV is freed."""
        stream = self.front.submit(
            request_id,
            params,
            prompt=prompt,
            messages=messages,
            fill_max_tokens=fill_max_tokens,
            add_special_tokens=add_special_tokens,
            # Clocks of two processes differ: the wait so far, on this one's clock.
            arrival_time=time.monotonic() - waited_s,
        )
        try:
            while True:
                item = await stream.get()
                yield item
                if ends_stream(item):
                    return
        finally:
            self.front.abort(stream)

    async def tokenize(self, t: Tokenize) -> list[int] | Rejected:
        """/tokenize on this replica's tokenizer (bad input comes back as Rejected)."""
        try:
            return await self.front.tokenize(t)
        except ValueError as exc:
            return Rejected(str(exc))

    async def detokenize(self, token_ids: list[int]) -> str | Rejected:
        try:
            return await self.front.detokenize(token_ids)
        except ValueError as exc:
            return Rejected(str(exc))

    async def check_structured_output(self, so: StructuredOutput) -> None | Rejected:
        try:
            await self.front.check_structured_output(so)
        except ValueError as exc:
            return Rejected(str(exc))
        return None

    async def record_routing_stats(self) -> dict[str, float]:
        """What the SLO router ranks this replica by; the metrics go to the board meanwhile."""
        self.board.put.remote(self.name, self.front.metrics.render())
        if not self.front.alive:  # a dead engine takes nothing
            return {**asdict(ReplicaStats(10**6, math.inf, 0.0)), "stamp": time.time()}
        return {**asdict(self._stats), "stamp": self._stats_at}

    async def check_health(self) -> None:
        if not self.front.alive:
            raise RuntimeError("the engine thread has stopped")

    async def __del__(self) -> None:
        """Serve's graceful shutdown, once ongoing requests drained: stop the engine."""
        await self.front.shutdown()


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest Prometheus text of every replica, for the ingress's /metrics."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def get(self, max_age_s: float = 60.0) -> dict[str, bytes]:
        """Replicas heard from within `max_age_s` (a replica gone stops counting)."""
        now = time.monotonic()
        return {r: text for r, (t, text) in self.texts.items() if now - t <= max_age_s}


def relabel(texts: dict[str, bytes]) -> bytes:
    """One exposition of several: every sample gets a `replica` label naming its source."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text.decode()):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)

    class Families:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


class RemoteEngine(StreamBook):
    """The engine front of the ingress: each request goes to an engine replica through the
    deployment handle (routed by the deployment's request router) and its stream comes back
    item by item, the same items the single server's engine thread posts."""

    def __init__(self, handle: DeploymentHandle, metrics: ServerMetrics) -> None:
        super().__init__()
        self.handle = handle
        self.metrics = metrics
        self._pumps: dict[str, asyncio.Task] = {}
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    @property
    def alive(self) -> bool:
        return not self._stopped

    def start(self) -> None:
        return None

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopped = True
        for task in list(self._pumps.values()):
            task.cancel()

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        fill_max_tokens: bool = False,
        arrival_time: float | None = None,
        add_special_tokens: bool | None = None,
    ) -> RequestStream:
        stream = self._open(request_id)
        self._loop = stream.loop
        self._streams[request_id] = stream
        waited = 0.0 if arrival_time is None else max(0.0, time.monotonic() - arrival_time)
        call = (request_id, params, prompt, messages, fill_max_tokens, waited, add_special_tokens)
        self._pumps[request_id] = asyncio.create_task(self._pump(stream, call))
        return stream

    async def _pump(self, stream: RequestStream, call: tuple) -> None:
        params: SamplingParams = call[1]
        gen = cast(
            DeploymentResponseGenerator,
            self.handle.options(stream=True).generate.remote(*call, slo_tpot_ms=params.slo_tpot_ms),
        )
        ended = False
        try:
            async for item in gen:
                self._deliver([(stream, item)])
                if ends_stream(item):
                    ended = True
                    return
            self._deliver([(stream, EngineFailed("the replica ended the stream early"))])
            ended = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica died, or the call could not be routed
            logger.warning("request %s failed on its replica: %s", stream.request_id, exc)
            self._deliver([(stream, EngineFailed(f"the replica serving it failed: {exc}"))])
            ended = True
        finally:
            if not ended:
                gen.cancel()  # the replica's generator sees CancelledError: KV freed there
            self._pumps.pop(stream.request_id, None)
            self._streams.pop(stream.request_id, None)

    async def tokenize(self, t: Tokenize) -> list[int]:
        return await self._ask(self.handle.tokenize.remote(t))

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._ask(self.handle.detokenize.remote(token_ids))

    async def check_structured_output(self, so: StructuredOutput) -> None:
        await self._ask(self.handle.check_structured_output.remote(so))

    async def _ask(self, call: Any) -> Any:
        """A replica's answer; its Rejected as ValueError (400), its failure as RuntimeError."""
        try:
            answer = await call
        except Exception as exc:
            raise RuntimeError(f"no replica could answer: {exc}") from exc
        if isinstance(answer, Rejected):
            raise ValueError(answer.message)
        return answer

    def abort(self, stream: RequestStream) -> None:
        if not stream.done:
            self._mark_done(stream)
            task = self._pumps.get(stream.request_id)
            if task is not None:
                task.cancel()

    def abort_all(self) -> None:
        """End every open request (thread-safe). The single server's drain timer calls it;
        under Ray Serve the replicas' graceful shutdown bounds a drain instead."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort_open)

    def _abort_open(self) -> None:
        for task in list(self._pumps.values()):
            task.cancel()
        pending: list[tuple[RequestStream, StreamItem]] = [
            (s, EngineFailed(ENGINE_STOPPED)) for s in self._streams.values() if not s.done
        ]
        self._deliver(pending)


class SLORequestRouter(RequestRouter):
    """Ray Serve request router ranking replicas by `Router("slo")` over their published
    `ReplicaStats`, with a reservation per replica between two snapshots."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`request_router_kwargs`: `headroom` and `ttft_budget_s` of `Router`."""
        self.headroom = float(kwargs.get("headroom", SchedulerConfig.slo_headroom))
        self.ttft_budget_s = float(kwargs.get("ttft_budget_s", 1.0))
        self._reserved: dict[ReplicaID, int] = {}
        self._stamps: dict[ReplicaID, float] = {}
        self._lock = threading.Lock()  # the router's loop and Serve's callbacks may differ

    def _stats(self, replica: RunningReplica) -> ReplicaStats:
        published = replica.routing_stats or {}
        names = {f.name for f in fields(ReplicaStats)}
        if names <= published.keys():
            stats = ReplicaStats(**{k: published[k] for k in names})
        else:  # not heard from yet (just started): an empty replica
            stats = ReplicaStats(0, 0.0, 0.0)
        stamp = float(published.get("stamp", 0.0))
        rid = replica.replica_id
        if self._stamps.get(rid) != stamp:  # a new snapshot counts what was sent before it
            self._stamps[rid], self._reserved[rid] = stamp, 0
        return stats

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        slo = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait, not spin
            slo = pending_request.kwargs.get("slo_tpot_ms")
        with self._lock:
            router = Router("slo", len(candidate_replicas), self.headroom, 0, self.ttft_budget_s)
            stats = [self._stats(r) for r in candidate_replicas]
            router.stats = stats
            router.reserved = [self._reserved.get(r.replica_id, 0) for r in candidate_replicas]
        order = router.rank(slo)
        if not order:  # no replica can meet it: its best replica's admission answers
            order = [router.fallback()]
        # Reserved now, not once the replica accepted: requests of one burst are ranked
        # before any of them lands, and would all see the same empty replica.
        first = candidate_replicas[order[0]].replica_id
        with self._lock:
            self._reserved[first] = self._reserved.get(first, 0) + 1
        return [[candidate_replicas[i]] for i in order]


@serve.ingress()
class Ingress:
    """The OpenAI-compatible app, in front of the engine deployment."""

    def __init__(
        self, engine: DeploymentHandle, cfg: ServerConfig, board: ray.actor.ActorHandle
    ) -> None:
        self.engine, self.cfg, self.board = engine, cfg, board

    async def __serve_build_asgi_app__(self) -> FastAPI:
        configure_logging(self.cfg.log_level)  # the cluster's stats line is written here
        info: ModelInfo = await self.engine.info.remote()
        metrics = ServerMetrics(
            self.cfg.slo_classes, model_name=info.name, vllm_aliases=self.cfg.vllm_metrics
        )
        front = RemoteEngine(self.engine, metrics)

        async def render() -> bytes:
            texts = await self.board.get.remote()
            # The ingress's own registry counts only what it refuses itself (bad requests,
            # keys); its engine gauges would be zeros beside the replicas' real ones.
            own = generate_latest(metrics.registry.restricted_registry(INGRESS_SAMPLES))
            return relabel({**texts, "ingress": own})

        return make_app(front, info, self.cfg, render)


def build_application(a: argparse.Namespace, cfg: ServerConfig, board: ray.actor.ActorHandle):
    """The bound application: the ingress over `a.replicas` engine replicas."""
    # pow2: Serve's default router (it ignores the stats; the metrics still ride on them).
    router: dict[str, Any] = {
        "request_routing_stats_period_s": STATS_PERIOD_S,
        "request_routing_stats_timeout_s": 5.0,
    }
    if a.router == "slo":
        router["request_router_class"] = SLORequestRouter
        # The replicas' own admission margin: a replica the router deems feasible admits.
        router["request_router_kwargs"] = {"headroom": a.slo_headroom}
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        num_replicas=a.replicas,
        # Replicas share the machine's cores by --threads, not by Ray's CPU accounting.
        ray_actor_options={"num_cpus": 0},
        # The engine batches and queues itself, and its admission refuses what it cannot
        # serve: Serve must not hold requests back at a handful per replica.
        max_ongoing_requests=10_000,
        request_router_config=RequestRouterConfig(**router),
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=a.shutdown_timeout_s or 20.0,
    )(EngineReplica)
    ingress = serve.deployment(
        name="adaserve-ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )(Ingress)
    return ingress.bind(engine.bind(a, cfg, board), cfg, board)


def serve_cluster(a: argparse.Namespace, cfg: ServerConfig) -> int:
    """`adaserve serve --replicas N`: start (or join) Ray, run the app, serve until a signal."""
    if a.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {a.replicas}")
    cores = len(os.sched_getaffinity(0))
    threads = a.threads or max(1, cores // a.replicas)
    args = argparse.Namespace(**{**vars(a), "threads": threads})
    if a.ray_address:
        ray.init(address=a.ray_address, namespace="serve")
    else:
        # Serve's proxy stays up 30 s after a shutdown begins, so that load balancers in
        # front of a multi-node cluster deregister it; a local one has none to wait for.
        os.environ.setdefault("RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S", "1")
        ray.init(num_cpus=cores, include_dashboard=False, namespace="serve")
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    board = MetricsBoard.remote()  # type: ignore[attr-defined]
    serve.run(build_application(args, cfg, board), name=APP_NAME, route_prefix="/")
    logger.info(
        "serving on http://%s:%d from %d replicas (%d threads each), router %s",
        cfg.host,
        cfg.port,
        a.replicas,
        threads,
        a.router,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # replicas finish what runs within their graceful shutdown timeout
    ray.shutdown()
    return 0


__all__ = [
    "EngineReplica",
    "Ingress",
    "MetricsBoard",
    "RemoteEngine",
    "SLORequestRouter",
    "build_application",
    "relabel",
    "serve_cluster",
]
