"""The scaler's process: the loop in the background, /metrics for Prometheus, /api/pools for people."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from queue_schemas.clients import redis_client, with_backoff
from scaler.backends import Backend, DryRunBackend, KubernetesBackend, LocalBackend
from scaler.service import LagReader, PoolReport, Scaler, controllers
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


def report_body(report: PoolReport) -> dict[str, Any]:
    s, v = report.signals, report.verdict
    return {
        "pool": report.lag.pool,
        "lag": report.lag.total,
        "partitions": {str(p): lag for p, lag in report.lag.partitions.items()},
        "status": report.status.value,
        "partition_status": {str(p): st.value for p, st in report.partition_status.items()},
        "held": report.held,
        "backlog": s.backlog,
        "arrival_rate": round(s.arrival_rate, 3),
        "forecast_rate": round(v.forecast, 3),
        "replicas": {"ready": s.ready, "starting": s.starting, "draining": s.draining, "desired": v.desired},
        "capacity_per_replica": round(s.capacity_per_replica, 3),
        "startup_s": round(s.startup_s, 1),
        "decision": {"action": v.action, "target": v.target, "reason": v.reason},
        "spec_decoding": report.spec_decoding,
        "read_at": report.lag.read_at,
    }


def create_app(settings: ScalerSettings) -> FastAPI:
    pools = list(settings.load_pools().pools)
    plans = controllers(pools)  # a bad scaling section fails here, before anything starts
    backend = make_backend(settings)
    scaler: dict[str, Scaler] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
        await with_backoff(
            admin.start,
            f"connecting to Kafka at {settings.kafka_bootstrap}",
            attempts=settings.connect_attempts,
        )
        await with_backoff(consumer.start, "kafka consumer start", attempts=settings.connect_attempts)
        redis = redis_client(settings)
        reader = LagReader(admin, consumer, settings.names, redis)
        scaler["loop"] = Scaler(reader, redis, backend, plans, settings.tick_s)
        task = asyncio.create_task(scaler["loop"].run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.to_thread(backend.close, settings.shutdown_drain_s)
            await consumer.stop()
            await admin.close()
            await redis.aclose()

    app = FastAPI(title="sluice scaler", lifespan=lifespan, docs_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/pools")
    async def pool_reports() -> dict[str, Any]:
        reports = scaler["loop"].reports if "loop" in scaler else {}
        return {"pools": [report_body(r) for r in reports.values()]}

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
