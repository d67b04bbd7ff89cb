"""A request's protocol against a real Redis: the placement script's served-already rule and the start and
chunk scripts' owner fence decide as the Python reading of the same marks does."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from plumbing.protocol.request import (
    BEGIN_SCRIPT,
    CHUNK_SCRIPT,
    PLACE_SCRIPT,
    Begun,
    Placed,
    begin_keys,
    place_keys,
    served_already,
)
from queue_schemas.names import Names
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(30)

OWNERS = (None, "w1")
STARTED = (None, "w1", "w9")
ANSWERED = (None, "1")


@pytest.fixture
async def store(bus: Bus) -> AsyncIterator[tuple[aioredis.Redis, Names]]:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        yield redis, settings.names
    finally:
        await redis.aclose()


async def test_the_placement_script_and_served_already_agree(store: tuple[aioredis.Redis, Names]) -> None:
    redis, names = store
    for n, (owner, started, answered) in enumerate(itertools.product(OWNERS, STARTED, ANSWERED)):
        rid = f"req-agree-{n}"
        if owner is not None:
            await redis.set(names.placement(rid), owner)
        if started is not None:
            await redis.set(names.started(rid), started)
        if answered is not None:
            await redis.set(names.answered(rid), answered)
        reply = await redis.eval(PLACE_SCRIPT, 5, *place_keys(names, rid), "w2", 60_000, "", 0)
        outcome = Placed(reply[0].decode())
        case = (owner, started, answered)
        assert (outcome is Placed.DUPLICATE) == served_already(owner, started, answered), case
        if outcome is not Placed.DUPLICATE:
            assert outcome is (Placed.OWNED if owner else Placed.PLACED), case


async def test_a_started_request_moved_off_its_lost_owner_is_placed(
    store: tuple[aioredis.Redis, Names],
) -> None:
    redis, names = store
    rid = "req-moved"
    await redis.set(names.placement(rid), "w1")
    await redis.set(names.started(rid), "w1")  # served by w1 so far; w1 is lost
    reply = await redis.eval(PLACE_SCRIPT, 5, *place_keys(names, rid), "w2", 60_000, "w1", 0)
    assert Placed(reply[0].decode()) is Placed.PLACED


async def test_the_owner_fence_keeps_a_moved_workers_start_and_chunks_out(
    store: tuple[aioredis.Redis, Names],
) -> None:
    redis, names = store
    rid = "req-fenced"
    await redis.set(names.placement(rid), "w2")  # moved to w2 while w1 was presumed dead
    begun = await redis.eval(BEGIN_SCRIPT, 5, *begin_keys(names, rid), "w1", 60_000)
    assert Begun(begun.decode()) is Begun.MOVED
    chunk_keys = [names.placement(rid), names.replay(rid), names.stream_channel(rid)]
    assert await redis.eval(CHUNK_SCRIPT, 3, *chunk_keys, "w1", 0, b"x", 60_000, "") == 0
    assert await redis.eval(CHUNK_SCRIPT, 3, *chunk_keys, "w2", 0, b"x", 60_000, "") == 1
    assert await redis.eval(CHUNK_SCRIPT, 3, *chunk_keys, "", 1, b"y", 60_000, "") == 1  # a dispatcher
    assert await redis.hlen(names.replay(rid)) == 2
    begun = await redis.eval(BEGIN_SCRIPT, 5, *begin_keys(names, rid), "w2", 60_000)
    assert Begun(begun.decode()) is Begun.OK
