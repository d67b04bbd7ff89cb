"""The worker's start step against the real Redis-compatible server: the start check and the first chunk
are one script, so a request that may not start on this worker publishes nothing."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gpu_workers.starting import BEGIN_SCRIPT, STARTED_MARK_TTL_MS
from queue_schemas.clients import redis_client
from tests.conftest import Bus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_the_first_chunk_goes_out_only_with_a_successful_start(bus: Bus) -> None:
    names = bus.settings().names
    redis = redis_client(bus.settings())
    listener = aioredis.Redis.from_url(bus.redis_url)
    pubsub = listener.pubsub()
    begin = redis.register_script(BEGIN_SCRIPT)

    async def start(rid: str, worker: str) -> str:
        keys = [names.cancelled(rid), names.placement(rid), names.started(rid)]
        args: list[str | bytes | int] = [worker, STARTED_MARK_TTL_MS, names.stream_channel(rid)]
        args.append(f"first of {rid}".encode())
        outcome = await begin(keys=keys, args=args)
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    try:
        await pubsub.subscribe(*(names.stream_channel(rid) for rid in ("ok", "gone", "moved")))
        for _ in range(3):
            await pubsub.get_message(timeout=2)  # subscribe confirmations
        await redis.set(names.placement("ok"), "w1")
        await redis.set(names.placement("gone"), "w1")
        await redis.set(names.cancelled("gone"), "1")
        await redis.set(names.placement("moved"), "w2")

        assert await start("gone", "w1") == "cancelled"
        assert await start("moved", "w1") == "moved"
        assert await start("ok", "w1") == "ok"
        assert await redis.get(names.started("ok")) == b"w1"
        assert await redis.get(names.started("moved")) is None
        assert await redis.get(names.started("gone")) is None

        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert message is not None
        assert (message["channel"], message["data"]) == (names.stream_channel("ok").encode(), b"first of ok")
        assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5) is None

        # Without a channel (a batch request) the script only marks the start.
        assert await begin(keys=[names.cancelled("b"), names.placement("b"), names.started("b")],
                           args=["w1", STARTED_MARK_TTL_MS]) == b"ok"  # fmt: skip
        assert await redis.get(names.started("b")) == b"w1"
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await listener.aclose()
        await redis.aclose()
