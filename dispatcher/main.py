"""Entry point: `sluice dispatcher`. One process serves one pool, as one member of that pool's group."""

from __future__ import annotations

import asyncio
import signal

import uvloop
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from dispatcher.service import Dispatcher
from dispatcher.settings import DispatcherSettings
from openai_api.tokenizer import tokenizer_for
from plumbing.clients import (
    BusUnavailable,
    configure_logging,
    consumer_options,
    producer_options,
    redis_client,
    with_backoff,
)
from plumbing.health import Liveness, serve_metrics_and_health
from plumbing.model_store import ModelStore
from queue_schemas.config import ConfigError


async def serve(settings: DispatcherSettings, liveness: Liveness | None = None) -> None:
    try:
        pool = settings.load_pools().pool(settings.pool)
        # Batch submissions without token ids are tokenized here, as ingress does for HTTP requests.
        tokenizer = await asyncio.to_thread(tokenizer_for, pool, ModelStore(settings.model_cache_dir))
    except KeyError as exc:
        raise SystemExit(f"sluice dispatcher: {exc.args[0]}") from None
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"sluice dispatcher: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    redis = redis_client(settings)
    consumer = AIOKafkaConsumer(**consumer_options(settings, settings.names.dispatcher_group(settings.pool)))
    producer = AIOKafkaProducer(**producer_options(settings))
    await with_backoff(
        consumer.start,
        f"connecting to Kafka at {settings.kafka_bootstrap}",
        attempts=settings.connect_attempts,
    )
    await with_backoff(producer.start, "kafka producer start", attempts=settings.connect_attempts)
    try:
        await Dispatcher(settings, redis, consumer, producer, tokenizer, liveness=liveness).run(stop)
    finally:
        await consumer.stop()
        await producer.stop()
        await redis.aclose()


def run(settings: DispatcherSettings) -> None:
    configure_logging(settings, "dispatcher")
    liveness = Liveness()
    if settings.metrics_port:  # /metrics and /healthz
        serve_metrics_and_health(settings.metrics_port, settings.metrics_host, liveness)
    try:
        uvloop.run(serve(settings, liveness))
    except BusUnavailable as exc:
        raise SystemExit(f"sluice dispatcher: {exc}") from None
