"""Bearer-key authentication against the hashed keys in Redis, fetching the team's limits in the same trip."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queue_schemas.api_errors import ApiError, AuthenticationFailed, PermissionDenied, ServiceUnavailable
from queue_schemas.keys import TeamKey, hash_api_key
from queue_schemas.names import Names
from queue_schemas.quota import TeamLimits, TeamRecord

# KEYS: the key's record. ARGV: the team-record key prefix. Returns {} for an unknown key, else
# {key record, team record or ''}. One round trip instead of two on every request.
KEY_AND_TEAM = """
local key = redis.call('GET', KEYS[1])
if not key then return {} end
local ok, record = pcall(cjson.decode, key)
local team = ''
if ok and type(record) == 'table' and type(record['team']) == 'string' then
  team = redis.call('GET', ARGV[1] .. record['team']) or ''
end
return {key, team}
"""


@dataclass(frozen=True, slots=True)
class Caller:
    key: TeamKey
    limits: TeamLimits

    @property
    def team(self) -> str:
        return self.key.team


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("The Authorization header must be 'Bearer <key>'.")
    return token.strip()


class Authenticator:
    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        self._names = names
        self._lookup = redis.register_script(KEY_AND_TEAM)

    async def authenticate(self, authorization: str | None) -> Caller:
        token = bearer_token(authorization)
        try:
            reply = await self._lookup(
                keys=[self._names.api_key(hash_api_key(token))], args=[self._names.team("")]
            )
        except RedisError as exc:
            raise ServiceUnavailable("The key store is unreachable; retry shortly.") from exc
        if not reply:
            raise AuthenticationFailed("Incorrect API key provided.")
        raw_key, raw_team = reply
        try:
            key = TeamKey.model_validate_json(raw_key)
        except ValueError as exc:
            raise ApiError(
                "The record of this API key is corrupt; ask an operator to re-issue the key."
            ) from exc
        if not raw_team:  # fail closed: a team whose record is gone has no limits to enforce
            raise PermissionDenied(
                f"Team {key.team!r} has no record; ask an operator to restore it.", code="unknown_team"
            )
        try:
            return Caller(key, TeamRecord.model_validate_json(raw_team).limits)
        except ValueError as exc:
            raise ApiError(f"The record of team {key.team!r} is invalid; ask an operator to fix it.") from exc
