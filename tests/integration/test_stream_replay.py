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
from plumbing.replay import read_log
from queue_schemas.codec import encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import ErrorChunk, FinalChunk, StreamEvent, TokenChunk
from queue_schemas.settings import BusSettings
from tests.conftest import Bus
from tests.integration.helpers import make_request, pipeline

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

            async def read(rid: str, from_seq: int) -> list[StreamEvent]:
                return await read_log(p.redis, names, rid, from_seq)

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
