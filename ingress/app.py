"""The FastAPI application: lifespan owns the bus clients; handlers live in ingress.routes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import structlog
from aiokafka import AIOKafkaProducer
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ingress.auth import Authenticator
from ingress.batches.keeper import BatchKeeper
from ingress.batches.object_store import object_store
from ingress.batches.routes import router as batch_router
from ingress.context import IngressContext
from ingress.pool_gate import PoolGate
from ingress.responses.routes import router as responses_router
from ingress.responses.store import ResponseStore
from ingress.resume import STREAM_HEADER
from ingress.routes import router
from ingress.settings import IngressSettings
from ingress.streams import StreamHub
from ingress.tracing import TraceMiddleware
from ingress.usage_relay import UsageRelay
from openai_api.errors import ApiError, MethodNotAllowed, NotFound
from openai_api.quota_gate import QuotaGate
from openai_api.structured import preload_schema_compiler
from openai_api.tokenizer import tokenizer_for
from plumbing import tracing
from plumbing.clients import consumer_options, node_client, producer_options, redis_client, with_backoff
from plumbing.health import Liveness
from plumbing.loop_watch import watch_loop
from plumbing.model_store import ModelStore
from plumbing.tasks import stop_task

log = structlog.get_logger("sluice.ingress")
UPLOAD_SWITCH_INTERVAL_S = 0.001


def create_app(settings: IngressSettings) -> FastAPI:
    # Uploads are checked on threads of their own; a short switch interval lets the event loop take the
    # interpreter back within a millisecond of wanting it, so a large upload never stalls other streams.
    sys.setswitchinterval(UPLOAD_SWITCH_INTERVAL_S)
    pools = settings.load_pools()
    store = ModelStore(settings.model_cache_dir)
    log.info("loading tokenizers", pools=[p.name for p in pools.pools])
    tokenizers = {pool.name: tokenizer_for(pool, store) for pool in pools.pools}
    if any(pool.kind.compiles_schemas for pool in pools.pools) and not preload_schema_compiler():
        log.warning("vLLM's schema compiler is not installed; refused schemas show up as engine errors")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        liveness = Liveness()  # every background loop below registers here; /healthz reads it
        redis = redis_client(settings)
        # Its own connection, never renewed silently: a lost one must fail the streams it carried.
        hub_redis = redis_client(settings, retry=False)
        hub = StreamHub(
            hub_redis,
            settings.names.ingress_control_channel(),
            settings.stream_outage_s,
            node_client=partial(node_client, settings),
            liveness=liveness,
        )
        producer = AIOKafkaProducer(**producer_options(settings))
        await with_backoff(
            producer.start,
            f"connecting to Kafka at {settings.kafka_bootstrap}",
            attempts=settings.connect_attempts,
        )
        await hub.start()
        names = settings.names
        files = object_store(settings.files_store)
        keeper = BatchKeeper(
            names, pools, redis, producer, files,
            consumer_options(settings, names.batch_api_collector_group()), settings.batch_keeper_interval_s,
            caps=settings.team_caps(), file_expiry_s=settings.file_expiry_s,
            batch_retain_s=settings.batch_retain_s, liveness=liveness,
        )  # fmt: skip
        await keeper.start()
        relay = UsageRelay(
            names, redis, producer, settings.batch_keeper_interval_s, settings.usage_claim_idle_s, liveness
        )
        relay.start()
        loop_watch = asyncio.create_task(watch_loop(), name="loop-watch")
        liveness.watch("loop-watch", loop_watch)
        app.state.ctx = IngressContext(
            settings,
            pools,
            tokenizers,
            redis,
            hub,
            producer,
            Authenticator(redis, names),
            QuotaGate(redis, names),
            PoolGate(redis, names),
            files,
            ResponseStore(redis, names, settings.stream_publish, settings.responses_retain_s),
            liveness=liveness,
        )
        log.info("ingress ready", pools=[p.name for p in pools.pools])
        try:
            yield
        finally:
            app.state.ctx.checks.close()
            app.state.ctx.uploads.close()
            liveness.forget("loop-watch")
            await stop_task(loop_watch)
            await relay.close()
            await keeper.close()
            await hub.close()
            await producer.stop()
            await redis.aclose()
            await hub_redis.aclose()

    app = FastAPI(title="sluice ingress", lifespan=lifespan, openapi_url="/openapi.json", docs_url=None)
    if tracing.ENABLED:
        app.add_middleware(TraceMiddleware)
    if settings.cors_origins:  # a web page calling the API from a browser (fetch, EventSource)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],  # no credentials are allowed, so any request header may be
            expose_headers=[STREAM_HEADER],
        )
    app.include_router(router)
    app.include_router(batch_router)
    app.include_router(responses_router)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err: ApiError
        if exc.status_code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.")
        elif exc.status_code == 404:
            err = NotFound(f"Unknown path {request.url.path}.", code="unknown_url")
        else:
            err = ApiError(str(exc.detail))
            err.status = exc.status_code
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", error_type=type(exc).__name__)
        return JSONResponse(ApiError("The server had an error while processing your request.").body(), 500)

    return app
