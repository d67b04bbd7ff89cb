"""Per-team caps on what a team keeps on the service: files, their bytes, active batches and the lines
they hold, and stored responses. Each cap is checked and taken in one script, so concurrent uploads
cannot pass it together; what is freed (a file deleted or expired, a batch retired) is given back.

docs/operations.md lists the caps and their settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ingress.batches.api import as_text
from openai_api.errors import InvalidRequest, ServiceUnavailable
from plumbing.protocol.batches import GIVE_SCRIPT, RESPONSE_SCRIPT, TAKE_SCRIPT, responses_keys, storage_keys
from queue_schemas.names import Names

FILES, BYTES, BATCHES, BATCH_LINES = "files", "bytes", "batches", "batch_lines"


@dataclass(frozen=True, slots=True)
class TeamCaps:
    files: int
    file_bytes: int
    active_batches: int
    batch_lines: int
    stored_responses: int


class CapReached(InvalidRequest):
    status = 400
    code = "limit_reached"


CAP_MESSAGES = {
    FILES: "The team holds as many files as it may ({cap}); delete some or let them expire.",
    BYTES: "The team's files would pass its {cap}-byte storage limit; delete some or let them expire.",
    BATCHES: "The team has as many batches in progress as it may ({cap}); wait for one to finish.",
    BATCH_LINES: "The team's batches in progress would hold more than {cap} requests; wait for some.",
}


def cap_of(caps: TeamCaps, field: str) -> int:
    return {FILES: caps.files, BYTES: caps.file_bytes, BATCHES: caps.active_batches,
            BATCH_LINES: caps.batch_lines}[field]  # fmt: skip


def first_over(held: dict[str, int], amounts: dict[str, int], caps: TeamCaps) -> str | None:
    """The first field for which `amounts` more would pass the team's cap, or None."""
    for field, amount in amounts.items():
        if held.get(field, 0) + amount > cap_of(caps, field):
            return field
    return None


RESULT_ROOM = {FILES: 2, BYTES: 1}  # a batch's output and error files, and room for their bytes


class TeamStorage:
    def __init__(self, redis: aioredis.Redis, names: Names, caps: TeamCaps) -> None:
        self._redis = redis
        self._names = names
        self.caps = caps
        self._take = redis.register_script(TAKE_SCRIPT)
        self._give = redis.register_script(GIVE_SCRIPT)
        self._response = redis.register_script(RESPONSE_SCRIPT)

    async def take(self, team: str, amounts: dict[str, int], *, capped: bool = True) -> None:
        """Take `amounts` of the team's caps, or raise CapReached naming the first cap it would pass.
        Uncapped (`capped=False`) for what the service itself stores, such as a batch's result files."""
        args: list[str | int] = []
        for field, amount in amounts.items():
            args += [field, amount, cap_of(self.caps, field) if capped else -1]
        try:
            over = await self._take(keys=storage_keys(self._names, team), args=args)
        except RedisError as exc:
            raise ServiceUnavailable("The file index is unreachable; retry shortly.") from exc
        field = over.decode() if isinstance(over, bytes) else str(over)
        if field:
            raise CapReached(CAP_MESSAGES[field].format(cap=cap_of(self.caps, field)), code="limit_reached")

    async def check(self, team: str, amounts: dict[str, int], why: str = "") -> None:
        """Raise CapReached when `amounts` more would pass a cap, taking nothing (for what is stored later,
        such as a batch's result files, which are taken uncapped when written)."""
        try:
            raw = await self._redis.hgetall(self._names.team_storage(team))
        except RedisError as exc:
            raise ServiceUnavailable("The file index is unreachable; retry shortly.") from exc
        held = {as_text(k): int(v) for k, v in raw.items()}
        field = first_over(held, amounts, self.caps)
        if field is not None:
            message = CAP_MESSAGES[field].format(cap=cap_of(self.caps, field))
            raise CapReached(f"{message}{why}", code="limit_reached")

    async def give(self, team: str, amounts: dict[str, int]) -> None:
        args: list[str | int] = [x for item in amounts.items() for x in item]
        await self._give(keys=storage_keys(self._names, team), args=args)

    async def hold_response(self, team: str, response_id: str, expires_at: float) -> None:
        """Count a stored response against the team's cap until it expires, or raise CapReached."""
        args: list[str | int] = [
            f"{time.time():.3f}",
            self.caps.stored_responses,
            response_id,
            f"{expires_at:.3f}",
        ]
        try:
            added = await self._response(keys=responses_keys(self._names, team), args=args)
        except RedisError as exc:
            raise ServiceUnavailable("The response store is unreachable; retry shortly.") from exc
        if not int(added):
            raise CapReached(
                f"The team holds as many stored responses as it may ({self.caps.stored_responses}); "
                "send store=false, delete some, or wait for them to expire."
            )

    async def drop_response(self, team: str, response_id: str) -> None:
        await self._redis.zrem(self._names.team_responses(team), response_id)
