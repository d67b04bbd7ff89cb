"""The scripts that decide who may write a request's stream, against the real Redis-compatible server:
the start check and the first chunk are one script, so a request that may not start on this worker
publishes nothing; every later chunk is fenced on the placement; a move goes ahead only while the log is
as the dispatcher read it."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from dispatcher.acts import Acts
from dispatcher.hold import Held
from dispatcher.placement import Decision
from dispatcher.settings import DispatcherSettings
from gpu_workers.starting import STARTED_MARK_TTL_MS
from plumbing.clients import redis_client
from plumbing.protocol.request import BEGIN_SCRIPT, CHUNK_SCRIPT, chunk_args
from plumbing.replay import read_log
from queue_schemas.codec import encode
from queue_schemas.messages import TokenChunk
from tests.conftest import Bus
from tests.integration.helpers import make_request

pytestmark = pytest.mark.timeout(60)


async def test_the_first_chunk_goes_out_only_with_a_successful_start(bus: Bus) -> None:
    names = bus.settings().names
    redis = redis_client(bus.settings())
    listener = aioredis.Redis.from_url(bus.redis_url)
    pubsub = listener.pubsub()
    begin = redis.register_script(BEGIN_SCRIPT)

    async def start(rid: str, worker: str) -> str:
        keys = [names.cancelled(rid), names.placement(rid), names.started(rid), names.replay(rid)]
        keys.append(names.stream_channel(rid))
        args: list[str | bytes | int] = [worker, STARTED_MARK_TTL_MS, "PUBLISH"]
        args += [f"first of {rid}".encode(), 0, 60_000]
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
        assert await redis.hgetall(names.replay("ok")) == {b"0": b"first of ok"}, "logged as published"
        assert not await redis.exists(names.replay("moved"), names.replay("gone"))

        # Without a channel (a batch request) the script only marks the start.
        batch_keys = [names.cancelled("b"), names.placement("b"), names.started("b"), names.replay("b")]
        assert await begin(keys=batch_keys, args=["w1", STARTED_MARK_TTL_MS]) == b"ok"
        assert await redis.get(names.started("b")) == b"w1"
        assert not await redis.exists(names.replay("b"))
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await redis.aclose()


async def test_chunks_are_fenced_on_the_placement_and_a_move_needs_the_log_as_it_was_read(bus: Bus) -> None:
    settings = bus.settings(DispatcherSettings)
    assert isinstance(settings, DispatcherSettings)
    names = settings.names
    redis = redis_client(settings)
    chunk = redis.register_script(CHUNK_SCRIPT)

    async def write(worker: str, seq: int) -> int:
        event = TokenChunk(request_id="fenced-01", seq=seq, text=f"t{seq}", num_tokens=1, token_ids=(seq,))
        keys, args = chunk_args(names, event, encode(event), worker, 60_000, "PUBLISH")
        return int(await chunk(keys=keys, args=args))

    try:
        await redis.set(names.placement("fenced-01"), "w1")
        assert [await write("w1", 0), await write("w1", 1)] == [1, 1]
        # A dispatcher decided to move the request after reading two chunks; the old owner wrote a
        # third meanwhile: the move does not go ahead, and is decided again from the longer log.
        assert await write("w1", 2) == 1
        request = make_request("sim", "fenced-01")
        held = Held(request, None, None, 0.0, moved_from="w1", taken_over=request)
        acts = Acts(redis, settings, None, "d")  # no producer: placing never dead-letters
        decision = Decision("w2")
        assert await acts.place(held, decision, logged=2) == "changed"
        assert await acts.place(held, decision, logged=3) == "placed"
        assert await redis.get(names.placement("fenced-01")) == b"w2"
        # The old owner, presumed lost but still running, can no longer add to the stream.
        assert await write("w1", 3) == 0
        assert await write("w2", 3) == 1
        logged = await read_log(redis, names, "fenced-01")
        assert [e.text for e in logged if isinstance(e, TokenChunk)] == ["t0", "t1", "t2", "t3"]
    finally:
        await redis.aclose()
