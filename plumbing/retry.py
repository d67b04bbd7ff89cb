"""Backoff between tries, written once: every retry loop in the services takes its delays from here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from redis.exceptions import RedisError

T = TypeVar("T")


def doubling(first_s: float, max_s: float) -> Iterator[float]:
    """Delays between tries: `first_s`, then twice the last, at most `max_s`, for ever."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


async def through_outage(
    action: Callable[[], Awaitable[T]],
    outage_s: float,
    retrying: Callable[[BaseException], None],
    delays: Iterator[float] | None = None,
) -> T:
    """Run `action` until it succeeds, trying again while Redis is unreachable or failing (RedisError,
    OSError) for up to `outage_s`, at doubling delays from 50 ms to a second; `retrying` hears of each
    failure that is tried again. Past the outage, what the last try raised; any other error at once."""
    give_up = time.monotonic() + outage_s
    waits = delays if delays is not None else doubling(0.05, 1.0)
    while True:
        try:
            return await action()
        except (RedisError, OSError) as exc:
            delay = next(waits)
            if time.monotonic() + delay > give_up:
                raise
            retrying(exc)
            await asyncio.sleep(delay)
