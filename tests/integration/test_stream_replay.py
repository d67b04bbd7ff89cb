"""Streams outlive a Redis restart: the worker holds its chunks until Redis is back, the ingress's stream
hub subscribes again, and the relay fills what it missed from the request's replay log.

Each test runs its own Valkey (append-only file, fsync on every write) so it can kill it mid-stream;
the broker is the shared one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.launcher import ManagedProcess, free_port, start_redis
from ingress.relay import events
from ingress.streams import StreamHub
from plumbing.clients import redis_client
from plumbing.replay import LogState, read_log, read_log_state
from queue_schemas.codec import encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import ErrorChunk, FinalChunk, FinishReason, StreamEvent, TokenChunk, Usage
from queue_schemas.settings import BusSettings
from tests.conftest import Bus
from tests.integration.helpers import make_request, pipeline
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

SLOW = SimulatedEngineConfig(ttft_ms=5, token_ms=25)


@pytest.fixture
def own_redis(bus: Bus, tmp_path: Path) -> Iterator[tuple[Bus, list[ManagedProcess]]]:
    port = free_port()
    procs = [start_redis(port, tmp_path, persist=True)]
    try:
        yield Bus(bus.kafka_bootstrap, f"redis://127.0.0.1:{port}/0"), procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.parametrize("how", ["restart", "kill"])
async def test_a_stream_goes_on_without_a_gap_through_a_redis_restart(
    own_redis: tuple[Bus, list[ManagedProcess]], how: str
) -> None:
    private, procs = own_redis
    async with pipeline(private, engine=SLOW) as p:
        settings: BusSettings = p.settings
        names = settings.names
        hub_redis = redis_client(settings, retry=False)
        hub = StreamHub(hub_redis, names.ingress_control_channel(), outage_s=30)
        await hub.start()
        try:
            for _ in range(100):
                if hub.connected:
                    break
                await asyncio.sleep(0.05)
            req = make_request("sim", f"outlives-redis-{how}", max_tokens=80)
            sub = await hub.subscribe(names.stream_channel(req.request_id))
            await p.producer.send_and_wait(names.requests_topic("sim"), encode(req), key=b"k")

            async def read(rid: str, from_seq: int) -> LogState:
                return await read_log_state(p.redis, names, rid, from_seq)

            seen: list[StreamEvent] = []
            async for event in events(sub, req, read):
                seen.append(event)
                if len(seen) == 3:  # mid-stream: Redis goes away for a second
                    old = procs.pop()
                    if how == "kill":
                        os.kill(old.popen.pid, signal.SIGKILL)
                        old.popen.wait(5)
                    else:
                        old.stop()
                    await asyncio.sleep(1.0)
                    procs.append(old.relaunch())
            await sub.close()
        finally:
            await hub.close()
            await hub_redis.aclose()
        assert not [e for e in seen if isinstance(e, ErrorChunk)], seen[-1]
        assert isinstance(seen[-1], FinalChunk), seen[-1]
        assert [e.seq for e in seen] == list(range(len(seen))), "no gap, no repeat"
        text = "".join(e.text for e in seen if isinstance(e, TokenChunk | FinalChunk))
        logged = await read_log(p.redis, names, req.request_id)
        assert text == "".join(e.text for e in logged if isinstance(e, TokenChunk | FinalChunk))
        assert len(text) == seen[-1].usage.completion_tokens == 80


async def test_a_last_chunk_published_while_the_hub_reconnects_still_ends_the_stream(
    own_redis: tuple[Bus, list[ManagedProcess]],
) -> None:
    """The final chunk is published while the hub's pub/sub connection is down. No later chunk reveals the
    gap, so only the catch-up the hub asks for when it has subscribed again delivers it: without that the
    stream would wait out its deadline."""
    private, _ = own_redis
    settings = private.settings()
    names = settings.names
    req = make_request("sim", "last-chunk-in-the-gap", deadline_s=20)
    channel = names.stream_channel(req.request_id)
    writer = redis_client(settings)
    hub_redis = redis_client(settings, retry=False)
    hub = StreamHub(hub_redis, names.ingress_control_channel(), outage_s=30)
    await hub.start()
    try:

        async def connected() -> bool:
            return hub.connected

        await eventually(connected, 10, "the hub connected")
        sub = await hub.subscribe(channel)

        async def publish(event: StreamEvent) -> int:
            """What a worker's chunk write does: into the log, then to the channel. How many
            subscribers the channel had when it was published."""
            payload = encode(event)
            await writer.hset(names.replay(req.request_id), str(event.seq), payload)
            return int(await writer.publish(channel, payload))

        first = TokenChunk(request_id=req.request_id, seq=0, text="Hello", num_tokens=1)
        assert await publish(first) == 1, "the hub is subscribed"
        last = FinalChunk(
            request_id=req.request_id, seq=1, text=" there", num_tokens=1, finish_reason=FinishReason.STOP,
            usage=Usage(prompt_tokens=50, completion_tokens=2), worker_id="w0",
        )  # fmt: skip
        killed = await writer.client_kill_filter(_type="pubsub")
        assert killed == 1, "the hub's pub/sub connection, the only one on this server"
        assert await publish(last) == 0, "the final chunk was published while the hub was disconnected"

        async def read(rid: str, from_seq: int) -> LogState:
            return await read_log_state(writer, names, rid, from_seq)

        seen = [event async for event in events(sub, req, read)]
        await sub.close()
    finally:
        await hub.close()
        await hub_redis.aclose()
        await writer.aclose()
    assert seen == [first, last]
