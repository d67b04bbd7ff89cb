"""Reply-topic prefixes against a real Redis: no team may hold a prefix that overlaps another team's, so
no team can read another's replies; the refusal never names the other team."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from infra.keys import overlapping_prefix, set_reply_prefixes
from queue_schemas.quota import TeamRecord
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(30)


def test_overlap_is_a_prefix_either_way() -> None:
    held = {"acme.replies.": "acme"}
    assert overlapping_prefix(["acme.replies."], held, "beta") == "acme.replies."
    assert overlapping_prefix(["acme.rep"], held, "beta") == "acme.rep"
    assert overlapping_prefix(["acme.replies.x"], held, "beta") == "acme.replies.x"
    assert overlapping_prefix(["beta.replies.", "acme.r"], held, "beta") == "acme.r"
    assert overlapping_prefix(["beta.replies."], held, "beta") is None
    assert overlapping_prefix(["acme.replies.v2"], held, "acme") is None  # a team's own never blocks it


async def test_a_team_cannot_claim_anothers_prefix(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        assert await set_reply_prefixes(redis, names, "acme", ["acme.replies."]) == ("acme.replies.",)
        for wanted in ("acme.replies.", "acme.rep", "acme.replies.stolen"):
            with pytest.raises(ValueError, match="another team") as refused:
                await set_reply_prefixes(redis, names, "mallory", [wanted])
            assert "acme" not in str(refused.value).replace(wanted, "")
        assert await set_reply_prefixes(redis, names, "mallory", None) == ()
        # A team may register its own again, and replace it; what it released is free for others.
        await set_reply_prefixes(redis, names, "acme", ["acme.replies.", "acme.other."])
        await set_reply_prefixes(redis, names, "acme", ["acme.v2."])
        assert await set_reply_prefixes(redis, names, "mallory", ["acme.replies."]) == ("acme.replies.",)
    finally:
        await redis.aclose()


async def test_two_teams_claiming_at_once_cannot_both_win(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    clients = [aioredis.Redis.from_url(settings.redis_url) for _ in range(8)]
    try:
        outcomes = await asyncio.gather(
            *(
                set_reply_prefixes(client, names, f"racer{n}", [f"race.{'x' * n}"])
                for n, client in enumerate(clients)
            ),
            return_exceptions=True,
        )
        assert sum(1 for o in outcomes if not isinstance(o, BaseException)) == 1, outcomes
        assert all(isinstance(o, ValueError) for o in outcomes if isinstance(o, BaseException))
    finally:
        for client in clients:
            await client.aclose()


async def test_prefixes_in_team_records_written_before_the_index_still_count(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        old = TeamRecord(team="elder", reply_prefixes=("elder.answers.",))
        await redis.set(names.team("elder"), old.model_dump_json())
        with pytest.raises(ValueError, match="another team"):
            await set_reply_prefixes(redis, names, "newcomer", ["elder.answers.mine."])
    finally:
        await redis.aclose()
