"""A request's protocol against a real Redis: the placement script's served-already rule and the start
script's owner fence decide as the Python reading of the same marks does, and so do a worker's chunk
writes (`still_owner`) and the control plane's (under the epoch the request has reached)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from plumbing.protocol.request import (
    BEGIN_SCRIPT,
    CONTROL_CHUNK_SCRIPT,
    PLACE_SCRIPT,
    Begun,
    Placed,
    begin_keys,
    chunk_commands,
    control_chunk_args,
    place_keys,
    served_already,
    still_owner,
)
from plumbing.replay import read_log
from queue_schemas.codec import encode
from queue_schemas.messages import ErrorChunk, TokenChunk
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
        reply = await redis.eval(PLACE_SCRIPT, 7, *place_keys(names, rid), "w2", 60_000, "")
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
    # From w1; the log held nothing, at epoch 0.
    move: list[str | bytes | int] = ["w1", 0, 0, 0, 60_000, "PUBLISH", b"mark"]
    reply = await redis.eval(PLACE_SCRIPT, 7, *place_keys(names, rid), "w2", 60_000, *move)
    assert (Placed(reply[0].decode()), reply[2]) == (Placed.PLACED, 1), "placed, at the next epoch"


async def test_the_owner_fence_keeps_a_moved_workers_start_out_and_its_writes_see_the_move(
    store: tuple[aioredis.Redis, Names],
) -> None:
    redis, names = store
    rid = "req-fenced"
    await redis.set(names.placement(rid), "w2")  # moved to w2 while w1 was presumed dead
    begun = await redis.eval(BEGIN_SCRIPT, 5, *begin_keys(names, rid), "w1", 60_000)
    assert Begun(begun.decode()) is Begun.MOVED

    async def write(worker: str, seq: int, epoch: int) -> bool:
        chunk = TokenChunk(request_id=rid, seq=seq, text=worker, num_tokens=1, token_ids=(1,), epoch=epoch)
        async with redis.pipeline(transaction=False) as pipe:
            for command in chunk_commands(names, chunk, encode(chunk), epoch, 60_000, ""):
                pipe.execute_command(*command)
            replies = await pipe.execute()
        return still_owner(replies[-1], worker)

    assert not await write("w1", 0, 0)
    assert await write("w2", 0, 0)
    await redis.rpush(names.moves(rid), 1)  # the request moved at seq 1: epoch 1 writes from there
    error = ErrorChunk(request_id=rid, seq=1, code="timeout", message="late")  # the control plane's
    keys, args = control_chunk_args(names, error, encode(error), 60_000, "PUBLISH")
    assert await redis.eval(CONTROL_CHUNK_SCRIPT, len(keys), *keys, *args) == 1
    assert await redis.hkeys(names.replay(rid)) == [b"0", b"1.1"], "logged under the epoch reached"
    assert [type(e) for e in await read_log(redis, names, rid)] == [TokenChunk, ErrorChunk]
    begun = await redis.eval(BEGIN_SCRIPT, 5, *begin_keys(names, rid), "w2", 60_000)
    assert Begun(begun.decode()) is Begun.OK


def test_still_owner_reads_the_placement_as_the_fence_does() -> None:
    assert still_owner(b"w1", "w1")
    assert still_owner(None, "w1"), "an expired record fences nobody"
    assert not still_owner(b"w2", "w1")
