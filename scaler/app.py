"""The scaler's process: the loop, /metrics for Prometheus, /dashboard and /api/* for people."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from plumbing.clients import admin_options, consumer_options, redis_client, with_backoff
from plumbing.health import Liveness, health_body
from plumbing.tasks import stop_task
from queue_schemas.names import Names
from scaler.backends import Backend, DryRunBackend, LocalBackend
from scaler.dashboard import dashboard_body, report_body, slowest, timeline_body
from scaler.kubernetes import KubernetesBackend
from scaler.service import SCALER_LOOP, LagReader, Scaler, controllers
from scaler.settings import ScalerSettings


def make_backend(settings: ScalerSettings) -> Backend:
    if settings.backend == "local":
        return LocalBackend(settings.worker_log_dir, os.environ)
    if settings.backend == "kubernetes":
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return KubernetesBackend(
            client.AppsV1Api(),
            client.CoreV1Api(),
            settings.kubernetes_namespace,
            settings.kubernetes_workload,
        )
    return DryRunBackend()


def create_app(settings: ScalerSettings) -> FastAPI:
    pools = list(settings.load_pools().pools)
    plans = controllers(pools)  # a bad scaling section fails here, before anything starts
    backend = make_backend(settings)
    scaler: dict[str, Scaler] = {}
    liveness = Liveness()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        admin = AIOKafkaAdminClient(**admin_options(settings))
        consumer = AIOKafkaConsumer(**consumer_options(settings, None))
        await with_backoff(
            admin.start,
            f"connecting to Kafka at {settings.kafka_bootstrap}",
            attempts=settings.connect_attempts,
        )
        await with_backoff(consumer.start, "kafka consumer start", attempts=settings.connect_attempts)
        redis = redis_client(settings)
        reader = LagReader(admin, consumer, settings.names, redis)
        scaler["loop"] = Scaler(reader, redis, backend, plans, settings.tick_s)
        task = asyncio.create_task(scaler["loop"].run(), name=SCALER_LOOP)
        liveness.watch(SCALER_LOOP, task)
        try:
            yield
        finally:
            liveness.forget(SCALER_LOOP)
            await stop_task(task)
            await asyncio.to_thread(backend.close, settings.shutdown_drain_s)
            await consumer.stop()
            await admin.close()
            await redis.aclose()

    app = FastAPI(title="sluice scaler", lifespan=lifespan, docs_url=None)
    page = resources.files("scaler").joinpath("dashboard.html").read_text(encoding="utf-8")

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        loop = scaler.get("loop")
        if loop is None:
            code, body = health_body(liveness)
        else:
            code, body = loop.health(liveness, settings.health_stale_s, time.monotonic())
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/pools")
    async def pool_reports() -> dict[str, Any]:
        reports = scaler["loop"].reports if "loop" in scaler else {}
        return {"pools": [report_body(r) for r in reports.values()]}

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/api/dashboard")
    async def dashboard_data() -> dict[str, Any]:
        loop = scaler.get("loop")
        if loop is None:
            return {"now": time.time(), "pools": [], "restarts": {}}
        body = dashboard_body(loop.reports, loop.history, time.time())
        body["restarts"] = await restart_counts(loop.redis, settings.names, backend)
        return body

    @app.get("/api/traces")
    async def recent_traces(minutes: float = 10.0, limit: int = 20) -> JSONResponse:
        """The slowest requests of the last `minutes` whose spans were recorded (plumbing.tracing)."""
        loop = scaler.get("loop")
        if not 0 < minutes <= 1440 or not 0 < limit <= 1000:
            return JSONResponse({"error": "minutes must be in (0, 1440], limit in (0, 1000]"}, 400)
        if loop is None:
            return JSONResponse({"requests": []})
        now = time.time()
        since = now - minutes * 60
        keys = [settings.names.slow_traces(m) for m in range(int(since // 60), int(now // 60) + 1)]
        try:
            async with loop.redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.zrange(key, 0, -1, withscores=True)
                replies = await pipe.execute()
        except RedisError as exc:
            return JSONResponse({"error": f"Redis: {exc}"}, status_code=503)
        members = [item for reply in replies for item in reply]
        return JSONResponse({"requests": slowest(members, since, limit)})

    @app.get("/api/traces/{request_id}")
    async def request_timeline(request_id: str) -> JSONResponse:
        """One request's hops as a timeline, from the spans its services recorded."""
        loop = scaler.get("loop")
        if not REQUEST_ID.fullmatch(request_id):
            return JSONResponse({"error": "not a request id"}, status_code=400)
        try:
            raw = [] if loop is None else await loop.redis.lrange(settings.names.trace(request_id), 0, -1)
        except RedisError as exc:
            return JSONResponse({"error": f"Redis: {exc}"}, status_code=503)
        if not raw:
            return JSONResponse({"error": f"no spans recorded for {request_id}"}, status_code=404)
        return JSONResponse(timeline_body(request_id, raw))

    @app.get("/api/lag")
    async def lag() -> dict[str, Any]:
        reports = scaler["loop"].reports if "loop" in scaler else {}
        return {
            "pools": [
                {
                    "pool": r.lag.pool,
                    "topic": r.lag.topic,
                    "group": r.lag.group,
                    "total": r.lag.total,
                    "partitions": {str(p): v for p, v in r.lag.partitions.items()},
                    "status": r.status.value,
                    "read_at": r.lag.read_at,
                }
                for r in reports.values()
            ]
        }

    return app


REQUEST_ID = re.compile(r"[A-Za-z0-9_\-]{8,128}")


async def restart_counts(redis: aioredis.Redis, names: Names, backend: Backend) -> dict[str, int]:
    """Processes that exited and were started again: the dev stack's (counted in Redis by `sluice dev`)
    and, with the local backend, workers that exited unasked (replaced by the scaler)."""
    counts: dict[str, int] = {}
    with contextlib.suppress(RedisError):
        raw = await redis.hgetall(names.restarts())
        counts = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
    if isinstance(backend, LocalBackend):
        for pool, exits in backend.exits.items():
            counts[f"workers of {pool}"] = exits
    return dict(sorted(counts.items()))
