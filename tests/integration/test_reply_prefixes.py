"""Reply-topic prefixes against a real Redis: no team may hold a prefix that overlaps another team's, so
no team can read another's replies; the refusal never names the other team."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import redis.asyncio as aioredis

from infra.keys import create_key, overlapping_prefix, set_reply_prefixes
from plumbing.protocol.teams import CLAIM_SCRIPT, claim_keys
from queue_schemas.names import Names
from queue_schemas.teams import TeamRecord
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(30)


async def test_a_team_cannot_claim_anothers_prefix(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        assert await set_reply_prefixes(redis, names, "orion", ["shared.replies."]) == ("shared.replies.",)
        for wanted in ("shared.replies.", "shared.rep", "shared.replies.stolen"):
            with pytest.raises(ValueError, match="another team") as refused:
                await set_reply_prefixes(redis, names, "mallory", [wanted])
            assert "orion" not in str(refused.value)
        assert await set_reply_prefixes(redis, names, "mallory", None) == ()
        # A team may register its own again, and replace it; what it released is free for others.
        await set_reply_prefixes(redis, names, "orion", ["shared.replies.", "shared.other."])
        await set_reply_prefixes(redis, names, "orion", ["orion.v2."])
        assert await set_reply_prefixes(redis, names, "mallory", ["shared.replies."]) == ("shared.replies.",)
        with pytest.raises(ValueError, match="another team"):
            await set_reply_prefixes(redis, names, "orion", ["shared."])
        assert await set_reply_prefixes(redis, names, "orion", None) == ("orion.v2.",)
    finally:
        await redis.aclose()


async def test_the_script_decides_as_the_pure_function_does(bus: Bus) -> None:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    held = {"ab.cd.": "a", "ab.x": "a", "zz.top.": "b", "q.": "c"}
    candidates = ["ab.", "ab.cd.", "ab.cd.e", "ab.xy", "zz.", "zz.top.1", "q.r", "qq.", "new.", ""]
    try:
        for n, (team, wanted) in enumerate(
            itertools.product(("a", "b", "c", "d"), itertools.combinations(candidates, 2))
        ):
            wanted_list = [w for w in wanted if w]
            keys = claim_keys(Names(f"{settings.names.prefix}x{n}"))
            await redis.hset(keys[0], items=[part for pair in held.items() for part in pair])
            refused = await redis.eval(CLAIM_SCRIPT, len(keys), *keys, team, *wanted_list)
            expected = overlapping_prefix(wanted_list, held, team)
            assert refused == (expected or ""), (team, wanted_list)
            after = await redis.hgetall(keys[0])
            if expected is None:
                kept = {p: owner for p, owner in held.items() if owner != team}
                assert after == kept | dict.fromkeys(wanted_list, team), (team, wanted_list)
            else:
                assert after == held, (team, wanted_list)
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


async def test_prefixes_in_team_records_the_index_lacks_still_count(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        old = TeamRecord(team="elder", reply_prefixes=("elder.answers.",))
        await redis.set(names.team("elder"), old.model_dump_json())
        with pytest.raises(ValueError, match="another team"):
            await set_reply_prefixes(redis, names, "newcomer", ["elder.answers.mine."])
        # An index that lost a prefix a record still grants: the claim indexes the record's first.
        await redis.hdel(names.reply_prefix_owners(), "elder.answers.")
        with pytest.raises(ValueError, match="another team"):
            await set_reply_prefixes(redis, names, "newcomer", ["elder."])
    finally:
        await redis.aclose()


async def test_a_team_name_a_group_prefix_could_not_keep_apart_is_refused(bus: Bus) -> None:
    settings = bus.settings()
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        for team in ("a.b", "Acme", ""):
            with pytest.raises(ValueError, match="invalid team name"):
                await set_reply_prefixes(redis, settings.names, team, ["dotted.replies."])
            with pytest.raises(ValueError, match="invalid team name"):
                await create_key(redis, settings.names, team)
        assert await redis.hgetall(settings.names.reply_prefix_owners()) == {}
    finally:
        await redis.aclose()
