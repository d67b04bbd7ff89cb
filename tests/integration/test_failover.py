"""kill -9 of a dispatcher or a worker under load: every request still ends exactly once at its client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from queue_schemas.clients import producer_options, redis_client
from queue_schemas.codec import decode, encode
from queue_schemas.messages import ErrorChunk, FinalChunk, Heartbeat, StreamEvent
from queue_schemas.settings import BusSettings
from tests.conftest import Bus
from tests.integration.helpers import Services, collect, create_topics, make_request, terminals

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POOL_FILE = """
[[pools]]
name = "sim"
model = "sluice-sim"
partitions = 4
[pools.simulated]
ttft_ms = 5
token_ms = {token_ms}
max_running = {max_running}
"""


async def wait_workers(redis: aioredis.Redis, settings: BusSettings, ids: list[str]) -> None:
    for _ in range(300):
        raws = await redis.mget([settings.names.heartbeat("sim", w) for w in ids])
        if all(raw is not None and decode(Heartbeat, raw).state == "ready" for raw in raws):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("workers not ready")


async def run_load(
    bus: Bus,
    tmp: Path,
    *,
    dispatchers: int,
    workers: int,
    token_ms: int,
    max_running: int,
    count: int,
    kill: str,
) -> tuple[dict[str, list[StreamEvent]], BusSettings, aioredis.Redis, Services]:
    settings = bus.settings()
    await create_topics(
        settings, settings.names.requests_topic("sim"), settings.names.deadletter_topic(), partitions=4
    )
    services = Services(settings, tmp, POOL_FILE.format(token_ms=token_ms, max_running=max_running))
    redis = redis_client(settings)
    for i in range(dispatchers):
        services.start(f"dispatcher-{i}", "dispatcher", "--pool", "sim")
    for i in range(workers):
        services.start(f"worker-{i}", "worker", "--pool", "sim", "--worker-id", f"w{i}")
    await wait_workers(redis, settings, [f"w{i}" for i in range(workers)])
    producer = AIOKafkaProducer(**producer_options(settings))
    await producer.start()
    requests = [make_request("sim", f"req-failover-{i:05d}", max_tokens=20) for i in range(count)]
    ready = asyncio.Event()
    collector = asyncio.create_task(collect(redis, settings, {r.request_id for r in requests}, 60, ready))
    await ready.wait()
    await asyncio.sleep(3)  # let the dispatchers form their group
    for i, req in enumerate(requests):
        await producer.send_and_wait(settings.names.requests_topic("sim"), encode(req), key=str(i).encode())
        if i == count // 3:
            services.kill9(kill)
        await asyncio.sleep(0.01)
    await producer.stop()
    return await collector, settings, redis, services


async def test_kill_a_dispatcher_under_load(bus: Bus, tmp_path: Path) -> None:
    events, _, redis, services = await run_load(
        bus, tmp_path, dispatchers=2, workers=2, token_ms=1, max_running=64, count=150, kill="dispatcher-0"
    )
    try:
        ends = {rid: terminals(evs) for rid, evs in events.items()}
        missing = [rid for rid, t in ends.items() if not t]
        doubled = [rid for rid, t in ends.items() if len(t) > 1]
        assert not missing, f"{len(missing)} requests never ended"
        assert not doubled, f"{len(doubled)} requests ended twice"
        assert all(isinstance(t[0], FinalChunk) for t in ends.values())
    finally:
        services.stop()
        await redis.aclose()


async def test_kill_a_worker_moves_its_unstarted_requests(bus: Bus, tmp_path: Path) -> None:
    events, settings, redis, services = await run_load(
        bus, tmp_path, dispatchers=1, workers=2, token_ms=60, max_running=2, count=24, kill="worker-0"
    )
    try:
        ends = {rid: terminals(evs) for rid, evs in events.items()}
        assert all(len(t) == 1 for t in ends.values()), {r: t for r, t in ends.items() if len(t) != 1}
        finals = {rid: t[0] for rid, t in ends.items() if isinstance(t[0], FinalChunk)}
        lost = {rid: t[0] for rid, t in ends.items() if isinstance(t[0], ErrorChunk)}
        # Only what w0 had started (at most max_running at once) may fail, and it fails as worker_lost.
        assert len(lost) <= 2
        assert all(err.code == "worker_lost" for err in lost.values())
        assert [await redis.get(settings.names.started(rid)) for rid in lost] == [b"w0"] * len(lost)
        # What w0 held but had not started was taken over and finished on w1.
        log = (services.logs / "dispatcher-0.log").read_text()
        took = [line for line in log.splitlines() if "took over a lost worker's inbox" in line]
        assert len(took) == 1, log[-2000:]
        taken = int(took[0].split("requests=")[1].split()[0])
        assert taken - len(lost) >= 1, "some queued requests were moved"
        assert sum(1 for f in finals.values() if f.worker_id == "w1") >= taken - len(lost)
    finally:
        services.stop()
        await redis.aclose()
