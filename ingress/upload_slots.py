"""Uploads in progress in one ingress: a team may have a few at a time, and the line-by-line check of an
upload runs on threads of its own, so no team's uploads take the threads or the turns other work needs."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from openai_api.errors import RateLimited

UPLOADS_PER_TEAM = 2
SCAN_THREADS = 2

T = TypeVar("T")


class UploadSlots:
    def __init__(self, per_team: int = UPLOADS_PER_TEAM, threads: int = SCAN_THREADS) -> None:
        self.per_team = per_team
        self._held: Counter[str] = Counter()
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None

    @contextmanager
    def slot(self, team: str) -> Iterator[None]:
        """Hold one of the team's upload places for the body of the `with`, or raise RateLimited."""
        if self._held[team] >= self.per_team:
            raise RateLimited(
                f"The team has {self.per_team} uploads in progress on this server; retry when one ends.",
                headers={"retry-after": "1"},
            )
        self._held[team] += 1
        try:
            yield
        finally:
            self._held[team] -= 1
            if not self._held[team]:
                del self._held[team]

    async def run(self, work: Callable[[], T]) -> T:
        """Run blocking `work` on the upload threads, `threads` at a time across every team."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="upload-scan")
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
