"""Entry point: `sluice worker`."""

from __future__ import annotations

import asyncio
import signal

import uvloop
from prometheus_client import start_http_server

from gpu_workers.engine import Engine
from gpu_workers.settings import WorkerSettings
from gpu_workers.simulated import SimulatedEngine
from gpu_workers.worker import Worker
from queue_schemas.clients import configure_logging, redis_client
from queue_schemas.config import ConfigError, PoolConfig
from queue_schemas.model_store import ModelStore


def build_engine(pool: PoolConfig, settings: WorkerSettings) -> Engine:
    if pool.engine == "simulated":
        config = pool.simulated.model_copy(update={"max_running": pool.engine_slots})
        return SimulatedEngine(config, pool.block_size, pool.max_loras)
    from gpu_workers.vllm_engine import VllmEngine

    return VllmEngine(pool, ModelStore(settings.model_cache_dir), settings.spec_decoding, settings.role)


async def serve(settings: WorkerSettings) -> int:
    try:
        pool = settings.load_pools().pool(settings.pool)
    except KeyError as exc:
        raise SystemExit(f"sluice worker: {exc.args[0]}") from None
    except ConfigError as exc:
        raise SystemExit(f"sluice worker: {exc}") from None
    redis = redis_client(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(
        settings, build_engine(pool, settings), redis, pool.model, pool.max_running, pool.light_slots
    )
    worker.tensor_parallel_size = pool.tensor_parallel_size
    try:
        return await worker.run(stop)
    finally:
        await redis.aclose()


def run(settings: WorkerSettings) -> None:
    configure_logging(settings, "worker")
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.metrics_host)
    code = uvloop.run(serve(settings))
    if code:
        raise SystemExit(code)
