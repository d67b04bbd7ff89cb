"""API key management: create, list and revoke team keys (stored as SHA-256 hashes only)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from queue_schemas.keys import TeamKey, hash_api_key, key_id, new_api_key
from queue_schemas.names import Names
from queue_schemas.quota import TeamLimits, TeamRecord


async def set_team_limits(redis: aioredis.Redis, names: Names, team: str, limits: TeamLimits) -> None:
    """Replace a team's quota limits (None fields are unlimited); they apply from the next request."""
    await redis.set(names.team(team), TeamRecord(team=team, limits=limits).model_dump_json())


async def team_limits(redis: aioredis.Redis, names: Names, team: str) -> TeamLimits:
    raw = await redis.get(names.team(team))
    return TeamLimits() if raw is None else TeamRecord.model_validate_json(raw).limits


async def create_key(redis: aioredis.Redis, names: Names, team: str, pools: tuple[str, ...] = ()) -> str:
    """Store a new key for `team` and return it; this is the only time the key itself is seen."""
    key = new_api_key()
    record = TeamKey(team=team, key_id=key_id(key), pools=pools, created_at=time.time())
    await redis.set(names.api_key(hash_api_key(key)), record.model_dump_json())
    # The team record is what batch submissions are checked against; a new team starts unlimited.
    await redis.set(names.team(team), TeamRecord(team=team).model_dump_json(), nx=True)
    return key


async def list_keys(redis: aioredis.Redis, names: Names) -> list[tuple[str, TeamKey]]:
    """(key hash, record) for every stored key."""
    out = []
    prefix = names.api_key("")
    async for raw_name in redis.scan_iter(match=prefix + "*", count=500):
        name = raw_name.decode()
        raw = await redis.get(name)
        if raw is not None:
            out.append((name.removeprefix(prefix), TeamKey.model_validate_json(raw)))
    return sorted(out, key=lambda item: (item[1].team, item[1].created_at))


async def revoke_key(redis: aioredis.Redis, names: Names, key_or_id: str) -> int:
    """Delete keys matching a full key or a key id shown by `list_keys`; returns how many were removed."""
    removed = 0
    for digest, record in await list_keys(redis, names):
        if key_or_id in (record.key_id, digest) or hash_api_key(key_or_id) == digest:
            removed += await redis.delete(names.api_key(digest))
    return int(removed)
