"""Entry point: `sluice worker`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

import uvloop
from redis.asyncio import Redis

from gpu_workers.engine import Engine
from gpu_workers.engines import build_engine
from gpu_workers.prefill import HandoffDesk
from gpu_workers.settings import WorkerSettings
from gpu_workers.worker import Worker
from plumbing.clients import configure_logging, redis_client
from plumbing.health import Liveness, serve_metrics_and_health
from plumbing.processes import descendants
from queue_schemas.config import ConfigError, PoolConfig


def handoff_desk(
    pool: PoolConfig, settings: WorkerSettings, engine: Engine, redis: Redis
) -> HandoffDesk | None:
    """The worker's side of prefill/decode handoffs, in a pool that splits requests."""
    if not pool.splits or pool.disaggregation is None:
        return None
    storage = pool.vllm.handoff_storage if pool.vllm is not None and pool.kind.vllm_section else None
    return HandoffDesk(
        redis, settings.names, engine, settings.worker_id, pool.name, pool.block_size, storage,
        pool.disaggregation.kv_ttl_s,
    )  # fmt: skip


async def serve(settings: WorkerSettings, liveness: Liveness | None = None) -> int:
    try:
        pool = settings.load_pools().pool(settings.pool)
    except KeyError as exc:
        raise SystemExit(f"sluice worker: {exc.args[0]}") from None
    except ConfigError as exc:
        raise SystemExit(f"sluice worker: {exc}") from None
    if settings.role == "both" and pool.scaling.prefill is not None:
        settings = settings.model_copy(update={"role": "decode"})  # the pool's other workers decode
    redis = redis_client(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine = build_engine(pool, settings)
    worker = Worker(
        settings, engine, redis, pool.model, pool.max_running, pool.light_slots,
        handoff_desk(pool, settings, engine, redis), liveness,
    )  # fmt: skip
    worker.tensor_parallel_size = pool.tensor_parallel_size
    try:
        code = await worker.run(stop)
    finally:
        await redis.aclose()
    if worker.stopped_starting or code:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Leave without waiting for what the process still runs: the engine's loader thread, which cannot
    be interrupted, or a background task or executor thread of a failed worker that does not unwind (the
    event loop's shutdown would wait for each). The worker has already published its state and left the
    pool. The processes the engine has started so far are killed first, so none outlives the worker."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(settings: WorkerSettings) -> None:
    configure_logging(settings, "worker")
    liveness = Liveness()
    if settings.metrics_port:  # /metrics and /healthz
        serve_metrics_and_health(settings.metrics_port, settings.metrics_host, liveness)
    code = uvloop.run(serve(settings, liveness))
    if code:
        raise SystemExit(code)
