"""Per-team caps against a real Redis: taken together or not at all, given back once, independent per team,
and stored responses counted until they expire."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from ingress.batches.api import as_text
from ingress.team_caps import (
    BATCH_LINES,
    BATCHES,
    BYTES,
    FILES,
    RESULT_ROOM,
    CapReached,
    TeamCaps,
    TeamStorage,
)
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(30)

CAPS = TeamCaps(files=3, file_bytes=1000, active_batches=2, batch_lines=100, stored_responses=2)


async def held(redis: aioredis.Redis, storage: TeamStorage, team: str) -> dict[str, int]:
    raw = await redis.hgetall(storage._names.team_storage(team))
    return {as_text(k): int(v) for k, v in raw.items()}


async def test_caps_are_taken_whole_or_not_at_all(bus: Bus) -> None:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        storage = TeamStorage(redis, settings.names, CAPS)
        await storage.take("acme", {FILES: 1, BYTES: 600})
        with pytest.raises(CapReached, match="1000-byte"):
            await storage.take("acme", {FILES: 1, BYTES: 500})
        assert await held(redis, storage, "acme") == {FILES: 1, BYTES: 600}  # nothing of the refused one
        await storage.take("beta", {FILES: 1, BYTES: 900})  # another team's caps are its own
        await storage.give("acme", {FILES: 1, BYTES: 600})
        await storage.give("acme", {FILES: 1, BYTES: 600})  # never below nothing
        assert await held(redis, storage, "acme") == {FILES: 0, BYTES: 0}
        await storage.take("acme", {BATCHES: 1, BATCH_LINES: 60})
        with pytest.raises(CapReached, match="more than 100 requests"):
            await storage.take("acme", {BATCHES: 1, BATCH_LINES: 60})
        await storage.take("acme", {FILES: 5, BYTES: 5000}, capped=False)  # the service's own results
        assert (await held(redis, storage, "acme"))[FILES] == 5
    finally:
        await redis.aclose()


async def test_concurrent_uploads_cannot_pass_a_cap_together(bus: Bus) -> None:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        storage = TeamStorage(redis, settings.names, CAPS)
        outcomes = await asyncio.gather(
            *(storage.take("acme", {FILES: 1, BYTES: 10}) for _ in range(10)), return_exceptions=True
        )
        assert sum(1 for o in outcomes if o is None) == CAPS.files
        assert all(isinstance(o, CapReached) for o in outcomes if o is not None)
    finally:
        await redis.aclose()


async def test_stored_responses_count_until_they_expire(bus: Bus) -> None:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        storage = TeamStorage(redis, settings.names, CAPS)
        now = time.time()
        await storage.hold_response("acme", "r1", now + 3)  # longer than the four calls take
        await storage.hold_response("acme", "r2", now + 60)
        await storage.hold_response("acme", "r2", now + 60)  # the same response again: no second place
        with pytest.raises(CapReached, match="stored responses"):
            await storage.hold_response("acme", "r3", now + 60)
        await asyncio.sleep(max(0.0, now + 3.1 - time.time()))  # r1's time is up: its place is free
        await storage.hold_response("acme", "r3", now + 60)
        await storage.drop_response("acme", "r2")
        await storage.hold_response("acme", "r4", now + 60)
    finally:
        await redis.aclose()


async def test_a_batch_needs_room_for_its_result_files(bus: Bus) -> None:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        storage = TeamStorage(redis, settings.names, CAPS)
        await storage.take("acme", {FILES: 1, BYTES: 10})
        await storage.check("acme", RESULT_ROOM)  # 1 file held: 2 more fit under 3
        await storage.take("acme", {FILES: 1, BYTES: 10})
        with pytest.raises(CapReached, match="as many files as it may") as refused:
            await storage.check("acme", RESULT_ROOM, why=" A batch needs room for its result files.")
        assert refused.value.body()["error"]["code"] == "limit_reached"
        assert await held(redis, storage, "acme") == {FILES: 2, BYTES: 20}  # a check takes nothing
        await storage.give("acme", {FILES: 1, BYTES: 10})
        await storage.take("acme", {BYTES: 990})  # all 1000 bytes held
        with pytest.raises(CapReached, match="1000-byte"):
            await storage.check("acme", RESULT_ROOM)  # full of bytes: no room for a result
    finally:
        await redis.aclose()
