"""Dispatcher and worker on the real broker and Redis: placement, streaming, dead letters, redelivery."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY
from redis.asyncio.client import PubSub

from gpu_workers.simulated import reply_text
from plumbing.deadletter import PAYLOAD_LIMIT
from queue_schemas.codec import MAX_MESSAGE_BYTES, decode_stream_event, encode
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    InferenceRequest,
    StreamEvent,
    TokenChunk,
    WorkerState,
)
from tests.conftest import Bus, read_dead_letters
from tests.integration.helpers import Pipeline, make_request, pipeline, wait_state
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)


async def collect_events(
    pubsub: PubSub, until_terminal: int = 1, within_s: float = 15.0
) -> list[StreamEvent]:
    """Stream events from the subscribed channel until `until_terminal` terminal chunks or `within_s`."""
    events: list[StreamEvent] = []
    terminal = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while terminal < until_terminal and loop.time() < deadline:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if msg is None:
            continue
        event = decode_stream_event(msg["data"])
        events.append(event)
        if not isinstance(event, TokenChunk):
            terminal += 1
    return events


async def send_and_collect(
    p: Pipeline, req: InferenceRequest, producer: AIOKafkaProducer | None = None
) -> list[StreamEvent]:
    """Produce one request to the pool's topic (with the pipeline's producer unless another is given)
    and gather its stream events until the terminal one."""
    async with p.redis.pubsub() as pubsub:
        await pubsub.subscribe(p.settings.names.stream_channel(req.request_id))
        topic = p.settings.names.requests_topic(req.pool)
        await (producer or p.producer).send_and_wait(topic, encode(req), key=b"k")
        return await collect_events(pubsub)


async def test_request_is_placed_and_streamed_back(bus: Bus) -> None:
    async with pipeline(bus) as p:
        req = make_request("sim", "req-stream-0001", max_tokens=12)
        events = await send_and_collect(p, req)
        final = events[-1]
        assert isinstance(final, FinalChunk), events
        text = "".join(e.text for e in events if isinstance(e, TokenChunk | FinalChunk))
        assert text == reply_text(req)[:12]
        assert [e.seq for e in events] == list(range(len(events)))
        assert final.usage.prompt_tokens == 50
        assert final.usage.completion_tokens == 12
        assert final.worker_id == p.worker_id


async def test_malformed_messages_are_dead_lettered_and_the_dispatcher_carries_on(bus: Bus) -> None:
    async with pipeline(bus) as p:
        names = p.settings.names
        topic = names.requests_topic("sim")
        good = make_request("sim", "req-after-poison-01", max_tokens=5)
        wrong_pool = make_request("other", "req-wrong-pool-001")
        async with p.redis.pubsub() as pubsub:
            await pubsub.subscribe(names.stream_channel(good.request_id))
            truncated = encode(good)[:40]
            wrong_schema = b'{"v": 1, "request_id": 5, "pool": "sim"}'
            huge = b'{"v": 1, "pad": "' + b"x" * (MAX_MESSAGE_BYTES + 1024) + b'"}'
            poison = (b"\x00not json", b'{"v": 99}', encode(wrong_pool), truncated, wrong_schema, huge)
            big = AIOKafkaProducer(bootstrap_servers=p.settings.kafka_bootstrap, max_request_size=8 << 20)
            await big.start()
            try:
                for payload in poison:
                    await big.send_and_wait(topic, payload, key=b"same")
            finally:
                await big.stop()
            await p.producer.send_and_wait(topic, encode(good), key=b"same")
            events = await collect_events(pubsub)
        assert isinstance(events[-1], FinalChunk), events

        letters = await read_dead_letters(p.settings.kafka_bootstrap, names, at_least=len(poison))
        reasons = sorted(letter.reason for letter in letters)
        assert len(letters) == len(poison), reasons
        assert sum("not valid JSON" in r for r in reasons) == 2  # the garbage and the truncated request
        assert any("unsupported schema version 99" in r for r in reasons)
        assert any("'other'" in r for r in reasons)
        assert any("invalid InferenceRequest" in r and "request_id" in r for r in reasons)
        assert any("exceeds" in r for r in reasons)
        assert all(letter.source == topic for letter in letters)
        assert max(len(letter.payload) for letter in letters) <= PAYLOAD_LIMIT, "a huge payload is cut"


def duplicates() -> float:
    sample = REGISTRY.get_sample_value(
        "sluice_dispatcher_outcomes_total", {"pool": "sim", "outcome": "duplicate"}
    )
    return sample or 0.0


async def test_a_redelivered_request_is_placed_once(bus: Bus) -> None:
    async with pipeline(bus) as p:
        names = p.settings.names
        req = make_request("sim", "req-twice-000001", max_tokens=4)
        duplicates_before = duplicates()
        async with p.redis.pubsub() as pubsub:
            await pubsub.subscribe(names.stream_channel(req.request_id))
            for _ in range(2):
                await p.producer.send_and_wait(names.requests_topic("sim"), encode(req), key=b"k")
            events = await collect_events(pubsub, until_terminal=1, within_s=15.0)

            async def second_seen() -> bool:
                return duplicates() == duplicates_before + 1

            await eventually(second_seen, 15, "the dispatcher saw the second copy")
            # Had the copy been placed too, it would end within this (4 tokens take milliseconds).
            events += await collect_events(pubsub, until_terminal=1, within_s=2.0)
        finals = [e for e in events if isinstance(e, FinalChunk | ErrorChunk)]
        assert len(finals) == 1, events
        assert await p.redis.get(names.placement(req.request_id)) == p.worker_id.encode()


async def test_expired_request_gets_a_timeout_error(bus: Bus) -> None:
    async with pipeline(bus) as p:
        req = make_request("sim", "req-expired-00001", deadline_s=-1)
        events = await send_and_collect(p, req)
        assert len(events) == 1
        assert isinstance(events[0], ErrorChunk)
        assert events[0].code == "timeout"


async def test_a_worker_drains_while_the_scaler_asks_and_is_ready_again_after(bus: Bus) -> None:
    """The Kubernetes backend's way down: a drain request in Redis, no signal. The worker takes no new
    placements (its readiness probe would fail), stays up, and returns when the request is withdrawn."""
    async with pipeline(bus, workers=2) as p:
        names = p.settings.names
        await p.redis.set(names.drain_request("w0"), b"1", ex=60)
        await wait_state(p, "w0", WorkerState.DRAINING)
        for i in range(4):
            req = make_request("sim", f"while-draining-{i}", max_tokens=3)
            assert isinstance((await send_and_collect(p, req))[-1], FinalChunk)
            assert await p.redis.get(names.placement(req.request_id)) == b"w1"
        await p.redis.delete(names.drain_request("w0"))
        await wait_state(p, "w0", WorkerState.READY)
        assert not p.crashed()
