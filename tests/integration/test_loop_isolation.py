"""A poisoned item ends alone, on the real broker and Redis: a request whose handling raises in a worker,
usage outbox entries that cannot become records, a stream message that cannot be handed to its reader.
Each is counted in `sluice_items_failed_total`, the loop goes on with the next item, and its liveness
stays ok."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY

from gpu_workers.engine import EngineOutput
from gpu_workers.handoff import KvTransfer
from gpu_workers.parts import REQUEST_FAULT
from gpu_workers.settings import WorkerSettings
from gpu_workers.simulated import SimulatedEngine
from gpu_workers.worker import Worker
from infra.usage_cli import read_usage
from ingress.streams import RESYNC, HubDisconnected, StreamHub
from ingress.usage_relay import UsageRelay
from plumbing.clients import producer_options, redis_client
from plumbing.health import Liveness
from queue_schemas.codec import encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, TokenChunk, Usage
from queue_schemas.names import INBOX_FIELD
from queue_schemas.usage import UsageStatus, usage_event
from tests.conftest import Bus
from tests.integration.helpers import collect, create_topics, make_request, wait_workers
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(90)


def failed_count(loop: str) -> float:
    return REGISTRY.get_sample_value("sluice_items_failed_total", {"loop": loop}) or 0.0


async def counted(loop: str, expected: float) -> None:
    async def reached() -> bool:
        return failed_count(loop) >= expected

    await eventually(reached, 20, f"{expected:g} items of {loop} counted as failed")
    assert failed_count(loop) == expected


class PoisonedEngine(SimulatedEngine):
    """The simulated engine, with a bug (not an EngineError) that strikes part-way through the requests
    named poisoned: after their first output."""

    def __init__(self, poisoned: set[str]) -> None:
        super().__init__(SimulatedEngineConfig(ttft_ms=5, token_ms=1), block_size=16)
        self.poisoned = poisoned

    async def generate(
        self, request: InferenceRequest, kv: KvTransfer | None = None
    ) -> AsyncIterator[EngineOutput]:
        outputs = cast(AsyncGenerator[EngineOutput, None], super().generate(request, kv))
        async with contextlib.aclosing(outputs):
            yielded = 0
            async for output in outputs:
                if yielded and request.request_id in self.poisoned:
                    raise RuntimeError("a bug in the handling of one request")
                yield output
                yielded += 1


async def test_a_request_whose_handling_raises_ends_alone_and_the_worker_serves_the_next(bus: Bus) -> None:
    settings = bus.settings(WorkerSettings, worker_id="w0", heartbeat_interval_s=0.2, drain_timeout_s=5)
    assert isinstance(settings, WorkerSettings)
    names = settings.names
    redis = redis_client(settings)
    poisoned, healthy = "p" * 16, "h" * 16
    worker = Worker(settings, PoisonedEngine({poisoned}), redis, "sluice-sim", max_running=4)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    requests_before = failed_count("worker.request")
    entries_before = failed_count("worker.inbox")
    try:
        await wait_workers(redis, settings, ["w0"], pool=settings.pool)
        subscribed = asyncio.Event()
        events = asyncio.create_task(collect(redis, settings, {poisoned, healthy}, 30, subscribed))
        await subscribed.wait()
        inbox = names.inbox("w0")
        await redis.xadd(inbox, {INBOX_FIELD: b"{not an inference request"})
        await counted("worker.inbox", entries_before + 1)  # a poison entry: dropped and counted
        await redis.xadd(inbox, {INBOX_FIELD: encode(make_request("sim", poisoned, max_tokens=40))})
        await counted("worker.request", requests_before + 1)
        await redis.xadd(inbox, {INBOX_FIELD: encode(make_request("sim", healthy))})
        seen = await events

        # The poisoned request streamed, then ended with the error chunk, alone.
        *tokens, last = seen[poisoned]
        assert tokens, seen[poisoned]
        assert all(isinstance(e, TokenChunk) for e in tokens), seen[poisoned]
        assert isinstance(last, ErrorChunk), seen[poisoned]
        assert (last.code, last.message) == (ErrorCode.ENGINE_ERROR, REQUEST_FAULT)
        # The next request is served in full.
        assert isinstance(seen[healthy][-1], FinalChunk), seen[healthy]
        assert [e for e in seen[healthy] if isinstance(e, ErrorChunk)] == []

        async def inbox_empty() -> bool:
            return bool(await redis.xlen(inbox) == 0)

        await eventually(inbox_empty, 10, "every entry acknowledged, the poisoned ones included")
        assert not running.done()
        assert worker.liveness.report() == (
            True,
            {"heartbeat": "ok", "cancels": "ok", "kv-events": "ok", "inbox": "ok"},
        )
        assert failed_count("worker.request") == requests_before + 1
    finally:
        stop.set()
        code = await asyncio.wait_for(running, 20)
        await redis.aclose()
    assert code == 0
    assert worker.liveness.report() == (True, {})  # a stopped worker forgets its loops


def usage_fields(rid: str, team: str, model: str = "sluice-sim") -> dict[Any, Any]:
    now = time.time()
    request = make_request("sim", rid).model_copy(update={"team": team, "model": model})
    event = usage_event(request, UsageStatus.COMPLETED, Usage(prompt_tokens=3, completion_tokens=2), now)
    return {b"e": event.model_dump_json().encode(), b"charged": b"5"}


async def test_usage_entries_that_cannot_be_relayed_are_dropped_alone_and_the_relay_goes_on(
    bus: Bus,
) -> None:
    settings = bus.settings()
    names = settings.names
    await create_topics(settings, names.usage_topic())
    redis = redis_client(settings)
    producer = AIOKafkaProducer(**producer_options(settings))
    await producer.start()
    liveness = Liveness()
    relay = UsageRelay(names, redis, producer, interval_s=0.1, claim_idle_s=0.5, liveness=liveness)
    before = failed_count("ingress.usage_relay")
    try:
        await redis.sadd(names.usage_teams(), "acme", "beta")
        acme, beta = names.usage_outbox("acme"), names.usage_outbox("beta")
        poison = [
            {**usage_fields("req-poison-inf", "acme"), b"charged": b"inf"},  # no integer charge
            {b"e": b"{not json", b"charged": b"1"},  # not a usage event
            usage_fields("req-poison-big", "acme", model="m" * 2_000_000),  # larger than any record
        ]
        await redis.xadd(acme, usage_fields("req-good-1", "acme"))
        for fields in poison:
            await redis.xadd(acme, fields)
        await redis.xadd(acme, usage_fields("req-good-2", "acme"))
        await redis.xadd(beta, usage_fields("req-good-3", "beta"))
        relay.start()

        async def relayed(expected: set[str]) -> bool:
            return {e.request_id for e in await read_usage(settings, idle_ms=200)} >= expected

        await eventually(
            lambda: relayed({"req-good-1", "req-good-2", "req-good-3"}), 30, "the good entries relayed"
        )
        await counted("ingress.usage_relay", before + len(poison))

        async def outboxes_empty() -> bool:
            return bool(await redis.xlen(acme) == 0 and await redis.xlen(beta) == 0)

        await eventually(outboxes_empty, 10, "every entry deleted, the dropped ones included")
        await redis.xadd(acme, usage_fields("req-good-4", "acme"))  # the next one after the poison
        await eventually(lambda: relayed({"req-good-4"}), 30, "an entry written after the poison relayed")
        ids = [e.request_id for e in await read_usage(settings, idle_ms=200)]
        assert sorted(ids) == ["req-good-1", "req-good-2", "req-good-3", "req-good-4"]
        assert liveness.report() == (True, {"usage-relay": "ok"})
        assert failed_count("ingress.usage_relay") == before + len(poison)
    finally:
        await relay.close()
        await producer.stop()
        await redis.aclose()
    assert liveness.report() == (True, {})


async def test_a_stream_message_that_cannot_be_handed_over_ends_its_reader_alone(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = bus.settings()
    names = settings.names
    liveness = Liveness()
    hub = StreamHub(redis_client(settings, retry=False), names.ingress_control_channel(), liveness=liveness)
    await hub.start()
    await hub.wait_ready(5)
    publisher = aioredis.Redis.from_url(bus.redis_url)
    broken_channel, other_channel = names.stream_channel("b" * 32), names.stream_channel("o" * 32)
    before = failed_count("ingress.stream_hub")
    try:
        broken = await hub.subscribe(broken_channel)
        other = await hub.subscribe(other_channel)

        def refuse(item: Any) -> None:
            raise RuntimeError("this reader cannot take the message")

        monkeypatch.setattr(broken, "deliver", refuse)
        await publisher.publish(broken_channel, b"lost")
        with pytest.raises(HubDisconnected):
            await broken.next(time.time() + 5)  # its reader ends...
        await publisher.publish(other_channel, b"one")
        assert await other.next(time.time() + 5) == b"one"  # ...and the connection's other streams go on
        await publisher.publish(broken_channel, b"again")  # nothing more is routed to the ended reader
        await publisher.publish(other_channel, b"two")
        assert await other.next(time.time() + 5) == b"two"
        assert failed_count("ingress.stream_hub") == before + 1

        # A message that names its channel but cannot be routed is dropped: its readers catch up.
        await hub._route_one(hub._shards["single"], [b"message", other_channel.encode()])
        assert await other.next(time.time() + 5) == RESYNC
        await publisher.publish(other_channel, b"three")
        assert await other.next(time.time() + 5) == b"three"
        assert failed_count("ingress.stream_hub") == before + 2
        assert hub.connected
        assert liveness.report() == (True, {"stream-hub-single": "ok"})
        await broken.close()
        await other.close()
        assert hub.open_subscriptions == 0
    finally:
        await hub.close()
        await publisher.aclose()
    assert liveness.report() == (True, {})
