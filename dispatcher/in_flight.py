"""Work the dispatcher runs beside its loop: admitting batch records and delivering answers.

Either can be slow for reasons a record controls (schemas to compile, a reply topic slow to refuse), so
neither runs inside a placement round. Each piece of work holds its record's offset open until it ends,
and counts against the batch hold's bound, so a flood of slow records pauses the batch partitions
rather than piling up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
from redis.exceptions import RedisError

from plumbing.clients import BusUnavailable

log = structlog.get_logger("sluice.dispatcher")


class InFlight:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def deliver(
        self, send: Callable[[], Awaitable[object]], done: Callable[[], None], retry: Callable[[], None]
    ) -> None:
        """Deliver an answer: `done` once it is delivered or dead-lettered, `retry` on a bus outage."""

        async def deliver() -> None:
            try:
                await send()
            except (RedisError, BusUnavailable) as exc:
                log.warning("answer not delivered yet; bus unavailable", error=str(exc))
                retry()
                return
            except Exception:  # never the loop's end: the record is done with, and logged
                log.exception("answer failed")
            done()

        self.start(deliver(), "answer")

    async def settle(self, timeout_s: float) -> None:
        """Give work under way a moment to end (at shutdown); what does not is redelivered."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
