"""Waiting for an event with a deadline, instead of sleeping for a guessed time.

`until` polls a condition from synchronous tests, `eventually` from async ones. Both return the
condition's first truthy value and fail with what was awaited, and the last value seen, at the deadline.
The poll interval only paces the checks; nothing depends on it being long enough.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02


def until(check: Callable[[], T], within_s: float, what: str) -> T:
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within_s:g} s: {what} (last seen: {value!r})")
        time.sleep(POLL_S)


async def eventually(check: Callable[[], Awaitable[T]], within_s: float, what: str) -> T:
    deadline = time.monotonic() + within_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within_s:g} s: {what} (last seen: {value!r})")
        await asyncio.sleep(POLL_S)
