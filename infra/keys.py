"""API key management: create, list and revoke team keys (stored as SHA-256 hashes only)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from plumbing.protocol.teams import CLAIM_SCRIPT, claim_keys
from queue_schemas.batch import TEAM_NAME, TOPIC_NAME
from queue_schemas.keys import TeamKey, hash_api_key, key_id, new_api_key
from queue_schemas.names import Names
from queue_schemas.signing import new_signing_key
from queue_schemas.teams import TeamLimits, TeamRecord


async def team_record(redis: aioredis.Redis, names: Names, team: str) -> TeamRecord:
    """The team's record; a team without one gets a new, unlimited record when it is first written."""
    raw = await redis.get(names.team(team))
    return TeamRecord(team=team) if raw is None else TeamRecord.model_validate_json(raw)


async def set_team_limits(redis: aioredis.Redis, names: Names, team: str, limits: TeamLimits) -> None:
    """Replace a team's quota limits (None fields are unlimited); they apply from the next request."""
    record = (await team_record(redis, names, team)).model_copy(update={"limits": limits})
    await redis.set(names.team(team), record.model_dump_json())


async def set_team_weight(redis: aioredis.Redis, names: Names, team: str, weight: float) -> None:
    """Set the team's share in the dispatchers' fair order (they re-read it within seconds)."""
    current = await team_record(redis, names, team)
    record = TeamRecord.model_validate({**current.model_dump(), "weight": weight})  # the bounds apply
    await redis.set(names.team(team), record.model_dump_json())


def reply_prefix_problem(prefix: str, names: Names) -> str | None:
    """Why a team may not own topics under `prefix`: it must be a topic-name prefix of its own, clear of
    sluice's topics (a team's results topic is its own already)."""
    if len(prefix) < 3 or not TOPIC_NAME.match(prefix):
        return f"reply prefix {prefix!r} must be 3 or more of the characters a topic name may hold"
    ours = names.prefix + "."
    if prefix.startswith(ours) or ours.startswith(prefix):
        return f"reply prefix {prefix!r} overlaps sluice's own topics ({ours}*)"
    return None


def prefixes_overlap(a: str, b: str) -> bool:
    """Whether a topic can be under both prefixes."""
    return a.startswith(b) or b.startswith(a)


def overlapping_prefix(wanted: list[str], held: dict[str, str], team: str) -> str | None:
    """The first of `wanted` that overlaps a prefix another team holds (`held`: prefix -> team).
    CLAIM_SCRIPT makes the same decision inside Redis."""
    for prefix in wanted:
        if any(owner != team and prefixes_overlap(prefix, other) for other, owner in held.items()):
            return prefix
    return None


async def set_reply_prefixes(
    redis: aioredis.Redis, names: Names, team: str, prefixes: list[str] | None
) -> tuple[str, ...]:
    """Replace the team's reply-topic prefixes when `prefixes` is given; the prefixes now in force. A
    prefix that overlaps one another team holds is refused (ValueError) without naming that team. The
    check, the release of the team's old prefixes and the claim of the new ones are one script over the
    owners index, so two teams cannot claim overlapping prefixes at once; the team record, which the
    services enforce, is written after the claim."""
    if not TEAM_NAME.match(team):
        raise ValueError(f"invalid team name {team!r}")
    record = await team_record(redis, names, team)
    if prefixes is None:
        return record.reply_prefixes
    for prefix in prefixes:
        problem = reply_prefix_problem(prefix, names)
        if problem is not None:
            raise ValueError(problem)
    await _index_prefixes_of_every_team(redis, names)
    keys = claim_keys(names)
    refused = _text(await redis.eval(CLAIM_SCRIPT, len(keys), *keys, team, *prefixes))
    if refused:
        raise ValueError(f"reply prefix {refused!r} overlaps a prefix another team holds")
    record = record.model_copy(update={"reply_prefixes": tuple(prefixes)})
    await redis.set(names.team(team), record.model_dump_json())
    return record.reply_prefixes


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _index_prefixes_of_every_team(redis: aioredis.Redis, names: Names) -> None:
    """Add to the owners index every prefix a team record holds that the index lacks (records written
    before the index existed, or a record write that did not follow its claim); an entry already there
    is left as it is, and an empty prefix, which grants nothing, is skipped. Run before each claim, so a
    prefix a record still grants is back in the index before another team asks for it."""
    async for key in redis.scan_iter(match=names.team("*"), count=500):
        raw = await redis.get(key)
        if raw is None:
            continue
        record = TeamRecord.model_validate_json(raw)
        for prefix in record.reply_prefixes:
            if prefix:
                await redis.hsetnx(names.reply_prefix_owners(), prefix, record.team)


async def create_signing_key(redis: aioredis.Redis, names: Names, team: str) -> tuple[str, str]:
    """Register a new Ed25519 signing key for the team's batch records: (private key PEM, key id).
    Only the public key is stored; the private key is returned once."""
    if not TEAM_NAME.match(team):
        raise ValueError(f"invalid team name {team!r}")
    pem, public_b64, key_id_ = new_signing_key()
    await redis.hset(names.signing_keys(team), key_id_, public_b64)
    await redis.set(names.team(team), TeamRecord(team=team).model_dump_json(), nx=True)
    return pem, key_id_


async def create_key(
    redis: aioredis.Redis,
    names: Names,
    team: str,
    pools: tuple[str, ...] = (),
    *,
    allow_priority: bool = False,
    adapters: tuple[str, ...] = (),
) -> str:
    """Store a new key for `team` and return it; this is the only time the key itself is seen."""
    if not TEAM_NAME.match(team):
        raise ValueError(f"invalid team name {team!r}")
    key = new_api_key()
    record = TeamKey(
        team=team, key_id=key_id(key), pools=pools, created_at=time.time(), allow_priority=allow_priority,
        adapters=adapters,
    )  # fmt: skip
    await redis.set(names.api_key(hash_api_key(key)), record.model_dump_json())
    # The team record is what batch submissions are checked against; a new team starts unlimited.
    await redis.set(names.team(team), TeamRecord(team=team).model_dump_json(), nx=True)
    return key


async def list_keys(redis: aioredis.Redis, names: Names) -> list[tuple[str, TeamKey]]:
    """(key hash, record) for every stored key."""
    out = []
    head, tail = names.api_key("\0").split("\0")  # the digest sits between these
    async for raw_name in redis.scan_iter(match=names.api_key("*"), count=500):
        name = raw_name.decode()
        raw = await redis.get(name)
        if raw is not None:
            digest = name.removeprefix(head).removesuffix(tail)
            out.append((digest, TeamKey.model_validate_json(raw)))
    return sorted(out, key=lambda item: (item[1].team, item[1].created_at))


async def revoke_key(redis: aioredis.Redis, names: Names, key_or_id: str) -> int:
    """Delete keys matching a full key or a key id shown by `list_keys`; returns how many were removed."""
    removed = 0
    for digest, record in await list_keys(redis, names):
        if key_or_id in (record.key_id, digest) or hash_api_key(key_or_id) == digest:
            removed += await redis.delete(names.api_key(digest))
    return int(removed)
