"""Running the dispatcher and a simulated worker in-process against the real bus."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dispatcher.service import Dispatcher
from dispatcher.settings import DispatcherSettings
from gpu_workers.main import handoff_desk
from gpu_workers.settings import WorkerSettings
from gpu_workers.simulated import SimulatedEngine
from gpu_workers.worker import Worker
from infra.keys import create_signing_key
from infra.launcher import ManagedProcess, spawn
from openai_api.tokenizer import ByteTokenizer
from plumbing.clients import consumer_options, producer_options, redis_client
from queue_schemas.codec import decode, decode_channel_message, encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    Heartbeat,
    InferenceRequest,
    KvRole,
    MoveMark,
    SamplingParams,
    StreamEvent,
    TokenChunk,
    WorkerState,
)
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings
from queue_schemas.signing import load_private_key, sign_record
from scaler.service import LagReader
from tests.conftest import Bus, read_to
from tests.waiting import eventually


async def create_topics(settings: BusSettings, *topics: str, partitions: int = 2) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, partitions, 1) for t in topics])
    finally:
        await admin.close()


def make_request(
    pool: str, request_id: str, max_tokens: int = 12, deadline_s: float = 60
) -> InferenceRequest:
    now = time.time()
    return InferenceRequest(
        request_id=request_id, pool=pool, model="sluice-sim", team="dev", prompt_token_ids=tuple(range(50)),
        sampling=SamplingParams(max_tokens=max_tokens), created_at=now, deadline=now + deadline_s,
    )  # fmt: skip


@dataclass
class Pipeline:
    settings: DispatcherSettings
    redis: aioredis.Redis
    producer: AIOKafkaProducer
    worker_id: str
    services: list[asyncio.Task[Any]]

    def crashed(self) -> list[BaseException]:
        """What ended any service before its stop: a service that dies of its input is a bug."""
        return [t.exception() for t in self.services if t.done() and t.exception() is not None]  # type: ignore[misc]


@contextlib.asynccontextmanager
async def lag_reader(settings: BusSettings) -> AsyncIterator[LagReader]:
    """The scaler's lag reader (an admin client and an offsets consumer), started and stopped with it."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    await consumer.start()
    try:
        yield LagReader(admin, consumer, settings.names)
    finally:
        await consumer.stop()
        await admin.close()


async def wait_workers(
    redis: aioredis.Redis,
    settings: BusSettings,
    ids: list[str],
    state: WorkerState = WorkerState.READY,
    pool: str = "sim",
    within_s: float = 30.0,
) -> None:
    """Until every one of the workers' heartbeats reports `state`."""

    async def reported() -> bool:
        raws = await redis.mget([settings.names.heartbeat(pool, w) for w in ids])
        return all(raw is not None and decode(Heartbeat, raw).state is state for raw in raws)

    await eventually(reported, within_s, f"workers {ids} reporting {state.value}")


async def leased(
    redis: aioredis.Redis, settings: BusSettings, topics: list[str], partitions: int, holders: int
) -> None:
    """Until every partition of the topics is leased, and split among `holders` dispatchers."""
    lease = settings.names.partition_lease("sim")
    keys = [lease.format(topic=t, partition=p) for t in topics for p in range(partitions)]

    async def split() -> bool:
        owners = await redis.mget(keys)
        return None not in owners and len(set(owners)) == holders

    await eventually(split, 30, f"partitions of {topics} leased to {holders} dispatchers")


@contextlib.asynccontextmanager
async def pipeline(
    bus: Bus,
    pool: str = "sim",
    workers: int = 1,
    engine: SimulatedEngineConfig | None = None,
    engines: list[SimulatedEngineConfig] | None = None,
    roles: list[KvRole] | None = None,
    **dispatcher_overrides: object,
) -> AsyncIterator[Pipeline]:
    """A dispatcher and `workers` simulated workers for `pool`, under a fresh prefix; stopped on exit.
    `engines` gives each worker its own engine settings (and sets how many workers there are); `roles`
    each worker's role, in a pool that splits prefill from decode."""
    settings = bus.settings(DispatcherSettings, pool=pool, **dispatcher_overrides)
    assert isinstance(settings, DispatcherSettings)
    names = settings.names
    await create_topics(
        settings, names.requests_topic(pool), names.batch_topic(pool), names.deadletter_topic()
    )
    redis = redis_client(settings)
    configs = engines or [engine or SimulatedEngineConfig(ttft_ms=5, token_ms=1)] * workers
    worker_ids = [f"w{i}" for i in range(len(configs))]
    pool_config = settings.load_pools().pool(pool)
    fleet = []
    for i, (wid, config) in enumerate(zip(worker_ids, configs, strict=True)):
        worker_settings = WorkerSettings(
            **{
                **settings.model_dump(),
                "worker_id": wid,
                "heartbeat_interval_s": 0.2,
                "drain_timeout_s": 5,
                "role": roles[i] if roles else "both",
            }
        )
        engine_ = SimulatedEngine(config, block_size=16)
        desk = handoff_desk(pool_config, worker_settings, engine_, redis)
        fleet.append(Worker(worker_settings, engine_, redis, "sluice-sim", config.max_running, handoffs=desk))
    consumer = AIOKafkaConsumer(**consumer_options(settings, names.dispatcher_group(pool)))
    producer = AIOKafkaProducer(**producer_options(settings))
    await consumer.start()
    await producer.start()
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(w.run(stop)) for w in fleet]
    dispatcher = Dispatcher(settings, redis, consumer, producer, ByteTokenizer())
    tasks.append(asyncio.create_task(dispatcher.run(stop)))
    try:
        # Ready as the dispatcher sees them: a heartbeat reaches Redis a moment before its view has it.
        await eventually(
            lambda: _seen_ready(dispatcher, worker_ids), 10, f"workers {worker_ids} ready to the dispatcher"
        )
        yield Pipeline(settings, redis, producer, worker_ids[0], tasks)
        assert not (crashed := Pipeline(settings, redis, producer, "", tasks).crashed()), crashed
    finally:
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=20)
        for task in pending:  # a service that does not stop is a bug: show where it is stuck
            task.print_stack()
        assert not pending, f"{len(pending)} services did not stop"
        await consumer.stop()
        await producer.stop()
        await redis.aclose()


async def _seen_ready(dispatcher: Dispatcher, worker_ids: list[str]) -> bool:
    beats = dispatcher.view.heartbeats
    return all(w in beats and beats[w].state is WorkerState.READY for w in worker_ids)


async def held_requests(p: Pipeline, pool: str) -> int:
    """How many requests the pool's dispatchers report holding (each reports its hold every second)."""
    keys = [key async for key in p.redis.scan_iter(match=p.settings.names.held(pool, "*"))]
    return sum(int(v or 0) for v in (await p.redis.mget(keys) if keys else []))


async def wait_state(p: Pipeline, worker_id: str, state: WorkerState, within_s: float = 10.0) -> None:
    await wait_workers(p.redis, p.settings, [worker_id], state, within_s=within_s)


class Services:
    """Dispatchers and workers as real processes, so they can be killed with SIGKILL."""

    def __init__(self, settings: BusSettings, tmp: Path, pool_file: str) -> None:
        config = tmp / "pools.toml"
        config.write_text(pool_file)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        self.env.update(
            SLUICE_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
            SLUICE_REDIS_URL=settings.redis_url,
            SLUICE_PREFIX=settings.prefix,
            SLUICE_CONFIG=str(config),
            SLUICE_KAFKA_FETCH_WAIT_MS="5",
            SLUICE_KAFKA_SESSION_TIMEOUT_MS="3000",
            SLUICE_KAFKA_HEARTBEAT_INTERVAL_MS="500",
            SLUICE_HEARTBEAT_INTERVAL_S="0.3",
            SLUICE_HEARTBEAT_TTL_MS="1500",
        )
        self.logs = tmp / "logs"
        self.procs: dict[str, ManagedProcess] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "infra.cli", *args]
        self.procs[name] = spawn(name, argv, self.logs, {**self.env, **(env or {})})

    def kill9(self, name: str) -> None:
        os.kill(self.procs[name].popen.pid, signal.SIGKILL)
        self.procs[name].popen.wait(5)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(timeout=10)


async def collect(
    redis: aioredis.Redis, settings: BusSettings, expected: set[str], within_s: float, ready: asyncio.Event
) -> dict[str, list[StreamEvent]]:
    """Every stream event of the expected requests until each has a terminal one (or time runs out).

    `ready` is set once the subscription is live, so the caller knows when to start producing.
    """
    events: dict[str, list[StreamEvent]] = {rid: [] for rid in expected}
    terminal: Counter[str] = Counter()
    deadline = time.monotonic() + within_s
    async with redis.pubsub() as pubsub:
        await pubsub.psubscribe(settings.names.stream_channel("*"))
        ready.set()
        while time.monotonic() < deadline and len(terminal) < len(expected):
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if msg is None:
                continue
            event = decode_channel_message(msg["data"])
            if isinstance(event, MoveMark):
                continue  # a move's mark, not a chunk
            if event.request_id in events:
                events[event.request_id].append(event)
                if not isinstance(event, TokenChunk):
                    terminal[event.request_id] += 1
        # Linger a little: a duplicate placement would show up as a second terminal event.
        linger = time.monotonic() + 1.0
        while time.monotonic() < linger:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if msg is not None:
                event = decode_channel_message(msg["data"])
                if not isinstance(event, MoveMark) and event.request_id in events:
                    events[event.request_id].append(event)
    return events


async def send_requests(settings: BusSettings, requests: list[InferenceRequest]) -> None:
    """Produce the requests to their pool's topic, each keyed by its position."""
    producer = AIOKafkaProducer(**producer_options(settings))
    await producer.start()
    try:
        for i, req in enumerate(requests):
            await producer.send_and_wait(
                settings.names.requests_topic(req.pool), encode(req), key=str(i).encode()
            )
    finally:
        await producer.stop()


def terminals(events: list[StreamEvent]) -> list[StreamEvent]:
    return [e for e in events if isinstance(e, FinalChunk | ErrorChunk)]


async def produce(
    settings: BusSettings, records: list[tuple[str, bytes]], signer: Ed25519PrivateKey | None = None
) -> None:
    """Write raw (topic, payload) records, as a plain Kafka client would; signed when `signer` is given."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await producer.start()
    try:
        for topic, payload in records:
            headers = None if signer is None else sign_record(signer, payload)
            await producer.send_and_wait(topic, payload, headers=headers)
    finally:
        await producer.stop()


async def register_signer(redis: aioredis.Redis, names: Names, team: str) -> Ed25519PrivateKey:
    """A new signing key registered for `team` (its team record is made if missing)."""
    pem, _ = await create_signing_key(redis, names, team)
    return load_private_key(pem)


def submission(request_id: str, body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"v": 1, "request_id": request_id, "custom_id": request_id, "team": "acme", "body": body, **fields}


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "sluice-sim", "messages": [{"role": "user", "content": text}], **fields}


async def keys_to_end(bootstrap: str, topic: str, within_s: float = 30.0) -> Counter[bytes]:
    """The key of every message on `topic`, from the start to the end it had when called."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=50
    )
    await consumer.start()
    keys: Counter[bytes] = Counter()
    try:
        async with asyncio.timeout(within_s):
            ends = await consumer.end_offsets(list(consumer.assignment()))
            while not await read_to(consumer, ends):
                batch = await consumer.getmany(timeout_ms=200, max_records=1000)
                keys.update(r.key or b"" for records in batch.values() for r in records)
    except TimeoutError:
        raise AssertionError(f"{topic} not read to its end within {within_s:g} s") from None
    finally:
        await consumer.stop()
    return keys


async def read_answers(bootstrap: str, topic: str, count: int, within_s: float) -> list[dict[str, Any]]:
    """Every message on the reply topic until `count` arrived (then a short wait for duplicates)."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=50
    )
    await consumer.start()
    answers: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and len(answers) < count:
            batch = await consumer.getmany(timeout_ms=500)
            answers += [json.loads(r.value) for records in batch.values() for r in records]
        batch = await consumer.getmany(timeout_ms=1000)
        answers += [json.loads(r.value) for records in batch.values() for r in records]
    finally:
        await consumer.stop()
    return answers
