"""The scaler's HTTP surface: /metrics for Prometheus, /api/lag for people and dashboards."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from queue_schemas.clients import redis_client, with_backoff
from scaler.lag import PoolLag
from scaler.service import LagReader, lag_loop
from scaler.settings import ScalerSettings


def create_app(settings: ScalerSettings) -> FastAPI:
    pools = [p.name for p in settings.load_pools().pools]
    latest: dict[str, PoolLag] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
        await with_backoff(admin.start, "kafka admin start")
        await with_backoff(consumer.start, "kafka consumer start")
        redis = redis_client(settings)
        reader = LagReader(admin, consumer, settings.names)
        task = asyncio.create_task(lag_loop(reader, redis, pools, settings.tick_s, latest))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
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

    @app.get("/api/lag")
    async def lag() -> dict[str, Any]:
        return {
            "pools": [
                {
                    "pool": lag.pool,
                    "topic": lag.topic,
                    "group": lag.group,
                    "total": lag.total,
                    "partitions": {str(p): v for p, v in lag.partitions.items()},
                    "read_at": lag.read_at,
                }
                for lag in latest.values()
            ]
        }

    return app
