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
    CANCEL_SCRIPT,
    CONTROL_CHUNK_SCRIPT,
    PLACE_SCRIPT,
    Begun,
    Placed,
    ResponseCancel,
    begin_keys,
    cancel_keys,
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
        reply = await redis.eval(PLACE_SCRIPT, 6, *place_keys(names, rid), "w2", 60_000, "")
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
    reply = await redis.eval(PLACE_SCRIPT, 6, *place_keys(names, rid), "w2", 60_000, *move)
    assert (Placed(reply[0].decode()), reply[2]) == (Placed.PLACED, 1), "placed, at the next epoch"


async def test_the_owner_fence_keeps_a_moved_workers_start_out_and_its_writes_see_the_move(
    store: tuple[aioredis.Redis, Names],
) -> None:
    redis, names = store
    rid = "req-fenced"
    await redis.set(names.placement(rid), "w2")  # moved to w2 while w1 was presumed dead
    begun = await redis.eval(BEGIN_SCRIPT, 5, *begin_keys(names, rid), "w1", 60_000)
    assert Begun(begun.decode()) is Begun.MOVED

    async def write(seq: int, epoch: int) -> bool:
        chunk = TokenChunk(request_id=rid, seq=seq, text="t", num_tokens=1, token_ids=(1,), epoch=epoch)
        async with redis.pipeline(transaction=False) as pipe:
            for command in chunk_commands(names, chunk, encode(chunk), epoch, 60_000, ""):
                pipe.execute_command(*command)
            replies = await pipe.execute()
        return still_owner(replies[-1], epoch)

    assert await write(0, 0)
    await redis.hset(names.replay(rid), "m", "1")  # the request moved at seq 1: epoch 1 writes from there
    assert not await write(1, 0), "the old epoch learns it was moved"
    assert await write(1, 1)
    error = ErrorChunk(request_id=rid, seq=2, code="timeout", message="late")  # the control plane's
    keys, args = control_chunk_args(names, error, encode(error), 60_000, "PUBLISH")
    assert await redis.eval(CONTROL_CHUNK_SCRIPT, len(keys), *keys, *args) == 1
    assert sorted(await redis.hkeys(names.replay(rid))) == [b"0", b"1", b"1.1", b"2.1", b"m"]
    assert [type(e) for e in await read_log(redis, names, rid)] == [TokenChunk, TokenChunk, ErrorChunk]
    begun = await redis.eval(BEGIN_SCRIPT, 5, *begin_keys(names, rid), "w2", 60_000)
    assert Begun(begun.decode()) is Begun.OK


async def test_a_cancel_ends_a_request_moved_before_it_started_under_its_epoch(
    store: tuple[aioredis.Redis, Names],
) -> None:
    redis, names = store
    rid = "req-cancel-moved"
    await redis.hset(names.replay(rid), "m", "0")  # restarted on another worker before any chunk
    chunk = ErrorChunk(request_id=rid, seq=0, code="cancelled", message="cancelled")
    keys = cancel_keys(names, rid)
    reply = await redis.eval(CANCEL_SCRIPT, len(keys), *keys, 60_000, encode(chunk), 60_000, "PUBLISH", "1")
    assert ResponseCancel(reply.decode()) is ResponseCancel.ENDED, "its moves are not a chunk"
    logged = await read_log(redis, names, rid)
    assert [type(e) for e in logged] == [ErrorChunk]
    assert await redis.hexists(names.replay(rid), "0.1"), "under the epoch it reached"


def test_still_owner_counts_the_moves_as_the_scripts_do() -> None:
    assert still_owner(None, 0)
    assert still_owner(b"4,9", 2)
    assert not still_owner(b"4", 0)
    assert not still_owner(None, 1), "a log lost or deleted under a moved request"
