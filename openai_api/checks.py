"""Running expensive request checks (JSON schema validation, grammar compiles) off the event loop.

A few threads take them, each bounded by a deadline, so one request's schemas can neither stall the
streams a process relays nor take more than their share of its cores. A check past its deadline is
answered as a 400; its thread finishes in the background (a compile cannot be interrupted), and the
bounded thread count keeps such leftovers from piling up beyond it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from openai_api.errors import InvalidRequest

T = TypeVar("T")
CHECK_THREADS = 2
CHECK_TIMEOUT_S = 10.0


class CheckRunner:
    def __init__(self, threads: int = CHECK_THREADS, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checks")
        self.timeout_s = timeout_s

    async def run(self, check: Callable[[], T], param: str) -> T:
        """`check()` in a check thread; a 400 naming `param` if it is not done within the deadline."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, check)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise InvalidRequest(
                f"Checking this request's schemas took longer than {self.timeout_s:g} s; simplify them.",
                param=param,
                code="schema_too_complex",
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
