"""Bearer-key authentication against the hashed keys in Redis, then the team's record for its limits.

Two reads: a key and its team live in different hash slots on a Redis Cluster."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from openai_api.errors import ApiError, AuthenticationFailed, PermissionDenied, ServiceUnavailable
from queue_schemas.keys import TeamKey, hash_api_key
from queue_schemas.names import Names
from queue_schemas.teams import TeamLimits, TeamRecord


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
        self._redis = redis

    async def authenticate(self, authorization: str | None) -> Caller:
        token = bearer_token(authorization)
        try:
            raw_key = await self._redis.get(self._names.api_key(hash_api_key(token)))
            if raw_key is None:
                raise AuthenticationFailed("Incorrect API key provided.")
            try:
                key = TeamKey.model_validate_json(raw_key)
            except ValueError as exc:
                raise ApiError(
                    "The record of this API key is corrupt; ask an operator to re-issue the key."
                ) from exc
            raw_team = await self._redis.get(self._names.team(key.team))
        except RedisError as exc:
            raise ServiceUnavailable("The key store is unreachable; retry shortly.") from exc
        if not raw_team:  # fail closed: a team whose record is gone has no limits to enforce
            raise PermissionDenied(
                f"Team {key.team!r} has no record; ask an operator to restore it.", code="unknown_team"
            )
        try:
            return Caller(key, TeamRecord.model_validate_json(raw_team).limits)
        except ValueError as exc:
            raise ApiError(f"The record of team {key.team!r} is invalid; ask an operator to fix it.") from exc
