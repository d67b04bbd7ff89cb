"""Partition leases against a real Redis: what a round keeps when a lease lapses part-way through it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis

from dispatcher.leases import Leases
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(60)

PARTITIONS = [("requests", p) for p in range(4)]


class LapsingRedis(aioredis.Redis):
    """Reads the leases, then, before the round's script runs, lets them lapse (a loop stalled past the
    lease between the two calls) or gives them to `taker`."""

    taker: str | None = None

    async def mget(self, keys: Sequence[str], *args: str) -> list[bytes | str | None]:  # type: ignore[override]
        values: list[bytes | str | None] = await super().mget(keys, *args)
        if self.taker is None:
            await self.delete(*keys)
        else:
            for key in keys:
                await self.set(key, self.taker, px=60_000)
        return values


@pytest.mark.parametrize("taker", [None, "b"])
async def test_a_lease_lapsing_during_a_round_stays_with_its_holder_unless_taken(
    bus: Bus, taker: str | None
) -> None:
    names = bus.settings().names
    plain = aioredis.Redis.from_url(bus.redis_url)
    lapsing = LapsingRedis.from_url(bus.redis_url)
    assert isinstance(lapsing, LapsingRedis)
    try:
        members, lease_key = names.dispatchers("sim"), names.partition_lease("sim")
        first = await Leases(plain, members, lease_key, "a", 1000).round(PARTITIONS, set())
        assert first.held == frozenset(PARTITIONS)
        lapsing.taker = taker
        again = await Leases(lapsing, members, lease_key, "a", 1000).round(PARTITIONS, set())
        if taker is None:  # nobody else consumed them: the holder keeps its place and its holds
            assert again.held == frozenset(PARTITIONS)
            owners = await plain.mget([lease_key.format(topic=t, partition=p) for t, p in PARTITIONS])
            assert owners == [b"a"] * len(PARTITIONS)
        else:  # another dispatcher holds them now: never two consumers by this round's doing
            assert again.held == frozenset()
    finally:
        await plain.aclose()
        await lapsing.aclose()
