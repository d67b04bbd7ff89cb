"""The dead letter for a record a consumer cannot use: where it came from, why, and its bytes (bounded)."""

from __future__ import annotations

from queue_schemas.messages import DeadLetter

PAYLOAD_LIMIT = 64 * 1024


def dead_letter(
    source: str, partition: int | None, offset: int | None, raw: bytes, reason: str, consumer: str, now: float
) -> DeadLetter:
    return DeadLetter(
        source=source,
        partition=partition,
        offset=offset,
        reason=reason,
        payload=raw[:PAYLOAD_LIMIT].decode(errors="replace"),
        consumer=consumer,
        failed_at=now,
    )
