"""Stopping background tasks: cancelled until they end, not cancelled once and hoped for.

On Python 3.11, `asyncio.wait_for` returns the awaited call's result instead of raising when a cancel
arrives just as that call finishes, and the task goes on as if never cancelled. redis-py awaits parts
of a command through it, so a loop cancelled during a Redis call could keep running, and a close that
awaited it would wait forever (an ingress whose server failed to start would never exit). A cancel is
therefore sent again, every RECANCEL_S, until the task ends; a task whose own clean-up on cancel awaits
for longer must shield that clean-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import structlog

log = structlog.get_logger("sluice.tasks")

RECANCEL_S = 2.0  # how often a task that is still running is cancelled again


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], timeout_s: float | None = None) -> None:
    """Cancel `tasks` and wait until each has ended, or until `timeout_s` passed (None: no limit).

    An error a task had ended with is logged, not raised, so a loop that had failed does not stop the
    close of what comes after it. The calling task is never among those waited for."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    current = asyncio.current_task()
    waiting = {task for task in tasks if task is not current}
    ended: set[asyncio.Task[Any]] = {task for task in waiting if task.done()}
    waiting -= ended
    while waiting:
        for task in waiting:
            task.cancel()
        pause = RECANCEL_S if deadline is None else min(RECANCEL_S, deadline - loop.time())
        if pause <= 0:
            break
        done, waiting = await asyncio.wait(waiting, timeout=pause)
        ended |= done
    for task in ended:
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a background task had failed", task=task.get_name(), error=repr(error))


async def stop_task(task: asyncio.Task[Any] | None, timeout_s: float | None = None) -> None:
    """stop_tasks for one task, which may be None (never started)."""
    if task is not None:
        await stop_tasks([task], timeout_s)
