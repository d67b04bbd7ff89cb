"""kill -9 of a dispatcher or a worker under load: every request still ends exactly once at its client,
and a killed worker's streams go on from another worker as one uninterrupted run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from gpu_workers.simulated import apply_stops, reply_text
from infra.launcher import free_port
from plumbing.clients import producer_options, redis_client
from queue_schemas.codec import encode
from queue_schemas.messages import FinalChunk, StreamEvent, TokenChunk
from queue_schemas.settings import BusSettings
from tests.conftest import Bus
from tests.integration.helpers import (
    Services,
    collect,
    create_topics,
    leased,
    make_request,
    send_requests,
    terminals,
    wait_workers,
)
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

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


async def streaming_on(
    redis: aioredis.Redis, settings: BusSettings, worker: str, request_ids: list[str]
) -> None:
    """Until a request placed on `worker` has sent two chunks while another placed there has not started."""
    names = settings.names

    async def streaming() -> bool:
        owners = await redis.mget([names.placement(r) for r in request_ids])
        mine = [r for r, o in zip(request_ids, owners, strict=True) if o == worker.encode()]
        sent = [await redis.hlen(names.replay(rid)) for rid in mine]
        return any(n >= 2 for n in sent) and 0 in sent

    await eventually(streaming, 10, f"a request streaming from {worker} and one waiting there")


def scrape(port: int, name: str, labels: str) -> float:
    """One counter's value from a service's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith(f"{name}{{") and labels in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


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
    metrics_ports: list[int],
) -> tuple[dict[str, list[StreamEvent]], BusSettings, aioredis.Redis, Services]:
    settings = bus.settings()
    await create_topics(
        settings, settings.names.requests_topic("sim"), settings.names.deadletter_topic(), partitions=4
    )
    services = Services(settings, tmp, POOL_FILE.format(token_ms=token_ms, max_running=max_running))
    redis = redis_client(settings)
    for i in range(dispatchers):
        services.start(
            f"dispatcher-{i}",
            "dispatcher",
            "--pool",
            "sim",
            env={"SLUICE_METRICS_PORT": str(metrics_ports[i])},
        )
    for i in range(workers):
        services.start(f"worker-{i}", "worker", "--pool", "sim", "--worker-id", f"w{i}")
    await wait_workers(redis, settings, [f"w{i}" for i in range(workers)])
    producer = AIOKafkaProducer(**producer_options(settings))
    await producer.start()
    # A TTFT SLO of a minute: requests may queue at a worker behind its running ones (with the pool's
    # 2 s, placement would hold them in the dispatcher instead), so a killed worker holds some unstarted.
    requests = [
        make_request("sim", f"req-failover-{i:05d}", max_tokens=20).model_copy(update={"ttft_slo_ms": 60_000})
        for i in range(count)
    ]
    ready = asyncio.Event()
    collector = asyncio.create_task(collect(redis, settings, {r.request_id for r in requests}, 60, ready))
    await ready.wait()
    await leased(redis, settings, [settings.names.requests_topic("sim")], 4, dispatchers)
    for i, req in enumerate(requests):
        await producer.send_and_wait(settings.names.requests_topic("sim"), encode(req), key=str(i).encode())
        if i == count // 3:
            if kill.startswith("worker"):  # mid-stream: once it has sent part of an answer
                await streaming_on(
                    redis, settings, f"w{kill.split('-')[1]}", [r.request_id for r in requests]
                )
            services.kill9(kill)
        await asyncio.sleep(0.01)
    await producer.stop()
    return await collector, settings, redis, services


async def test_kill_a_dispatcher_under_load(bus: Bus, tmp_path: Path) -> None:
    events, _, redis, services = await run_load(
        bus, tmp_path, dispatchers=2, workers=2, token_ms=1, max_running=64, count=150, kill="dispatcher-0",
        metrics_ports=[free_port(), free_port()],
    )  # fmt: skip
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


async def test_kill_a_worker_and_its_streams_go_on_from_the_other(bus: Bus, tmp_path: Path) -> None:
    port = free_port()
    events, _, redis, services = await run_load(
        bus, tmp_path, dispatchers=1, workers=2, token_ms=60, max_running=2, count=24, kill="worker-0",
        metrics_ports=[port],
    )  # fmt: skip
    try:
        for rid, evs in events.items():
            end = terminals(evs)
            assert [type(e) for e in end] == [FinalChunk], (rid, evs)
            assert [e.seq for e in evs] == list(range(len(evs))), (rid, "no gap, no repeat")
            text = "".join(e.text for e in evs if isinstance(e, TokenChunk | FinalChunk))
            request = make_request("sim", rid, max_tokens=20)
            assert text == apply_stops(reply_text(request), 20, ())[0], rid
            assert end[0].usage.completion_tokens == len(text)  # type: ignore[union-attr]
        # w0 was streaming (max_running at once) when it died: those went on from w1.
        moved = scrape(port, "sluice_dispatcher_migrations_total", 'outcome="moved"')
        restarted = scrape(port, "sluice_dispatcher_migrations_total", 'outcome="restarted"')
        assert 1 <= moved <= 2, moved
        assert restarted >= 1, "what w0 held but had not started was placed again"
    finally:
        services.stop()
        await redis.aclose()


async def test_a_worker_restarted_under_its_own_name_goes_on_from_what_it_left(
    bus: Bus, tmp_path: Path
) -> None:
    """A worker killed and started again at once with the same id (a container restart in its pod, or
    the local backend reusing the lowest free name) finds its unfinished entries in its inbox before
    any dispatcher misses its heartbeat: it hands them to the dispatchers, which move each one on from
    what its stream delivered; nothing starts over."""
    settings = bus.settings()
    names = settings.names
    await create_topics(settings, names.requests_topic("sim"), names.deadletter_topic(), partitions=4)
    services = Services(settings, tmp_path, POOL_FILE.format(token_ms=60, max_running=2))
    redis = redis_client(settings)
    try:
        services.start("dispatcher-0", "dispatcher", "--pool", "sim")
        services.start("worker-0", "worker", "--pool", "sim", "--worker-id", "w0")
        await wait_workers(redis, settings, ["w0"])
        await leased(redis, settings, [names.requests_topic("sim")], 4, 1)
        requests = [make_request("sim", f"req-same-name-{i:04d}", max_tokens=20) for i in range(4)]
        ready = asyncio.Event()
        collector = asyncio.create_task(collect(redis, settings, {r.request_id for r in requests}, 60, ready))
        await ready.wait()
        await send_requests(settings, requests)
        await streaming_on(redis, settings, "w0", [r.request_id for r in requests])
        services.kill9("worker-0")
        services.start("worker-0", "worker", "--pool", "sim", "--worker-id", "w0")
        events = await collector
        for rid, evs in events.items():
            assert [type(e) for e in terminals(evs)] == [FinalChunk], (rid, evs)
            assert [e.seq for e in evs] == list(range(len(evs))), (rid, "no gap, no repeat")
            text = "".join(e.text for e in evs if isinstance(e, TokenChunk | FinalChunk))
            assert text == apply_stops(reply_text(make_request("sim", rid, max_tokens=20)), 20, ())[0]
    finally:
        services.stop()
        await redis.aclose()


async def test_requests_held_while_their_partitions_move_are_placed_once(bus: Bus, tmp_path: Path) -> None:
    """Requests wait in a dispatcher's hold (no worker yet) while a second dispatcher joins, which makes
    the first re-read the partitions it keeps, and then the first is killed: the survivor reads every one
    of them again from the committed offsets, and each is placed and answered exactly once."""
    settings = bus.settings()
    topic = settings.names.requests_topic("sim")
    await create_topics(settings, topic, settings.names.deadletter_topic(), partitions=4)
    services = Services(settings, tmp_path, POOL_FILE.format(token_ms=1, max_running=64))
    redis = redis_client(settings)
    port = free_port()
    try:
        services.start("dispatcher-0", "dispatcher", "--pool", "sim", env={"SLUICE_METRICS_PORT": str(port)})
        await leased(redis, settings, [topic], 4, 1)
        requests = [make_request("sim", f"req-held-{i:05d}", max_tokens=5, deadline_s=120) for i in range(40)]
        ready = asyncio.Event()
        collector = asyncio.create_task(collect(redis, settings, {r.request_id for r in requests}, 90, ready))
        await ready.wait()
        await send_requests(settings, requests)

        def received() -> float:
            return scrape(port, "sluice_dispatcher_received_total", 'topic_kind="requests"')

        async def all_held() -> bool:
            return received() >= len(requests)

        async def read_again() -> bool:
            return received() > len(requests)

        await eventually(all_held, 20, "the first dispatcher holding every request")
        services.start("dispatcher-1", "dispatcher", "--pool", "sim")
        await leased(redis, settings, [topic], 4, 2)
        # Once the kept partitions are read again (received counts past the 40), their offsets were
        # committed as far as the first dispatcher's state allows; then it dies holding its requests.
        await eventually(read_again, 20, "the first dispatcher reading its kept partitions again")
        rounds = scrape(port, "sluice_dispatcher_commit_rounds_total", 'pool="sim"')

        async def committed_since() -> bool:  # two whole rounds after the reading: one began after it
            return scrape(port, "sluice_dispatcher_commit_rounds_total", 'pool="sim"') >= rounds + 2

        await eventually(committed_since, 20, "the first dispatcher's commit rounds after reading again")
        services.kill9("dispatcher-0")
        await leased(redis, settings, [topic], 4, 1)
        services.start("worker-0", "worker", "--pool", "sim", "--worker-id", "w0")
        events = await collector
        ends = {rid: terminals(evs) for rid, evs in events.items()}
        missing = [rid for rid, t in ends.items() if not t]
        assert not missing, f"{len(missing)} of {len(requests)} requests never answered"
        assert not [rid for rid, t in ends.items() if len(t) > 1], "requests answered twice"
        assert all(isinstance(t[0], FinalChunk) for t in ends.values())
    finally:
        services.stop()
        await redis.aclose()
