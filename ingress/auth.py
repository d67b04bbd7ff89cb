"""Bearer-key authentication against the hashed keys in Redis."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ingress.errors import ApiError, AuthenticationFailed, ServiceUnavailable
from queue_schemas.keys import TeamKey, hash_api_key
from queue_schemas.names import Names


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("The Authorization header must be 'Bearer <key>'.")
    return token.strip()


async def authenticate(redis: aioredis.Redis, names: Names, authorization: str | None) -> TeamKey:
    token = bearer_token(authorization)
    try:
        raw = await redis.get(names.api_key(hash_api_key(token)))
    except RedisError as exc:
        raise ServiceUnavailable("The key store is unreachable; retry shortly.") from exc
    if raw is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    try:
        return TeamKey.model_validate_json(raw)
    except ValueError as exc:
        raise ApiError("The record of this API key is corrupt; ask an operator to re-issue the key.") from exc
