"""Stopping background tasks: a task that missed its cancel is cancelled again; a bound is kept; errors
are logged, not raised."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from plumbing import tasks
from plumbing.tasks import stop_task, stop_tasks

pytestmark = pytest.mark.unit


async def misses_one_cancel(missed: list[int]) -> None:
    """A loop whose first cancel is lost, as Python 3.11's wait_for loses one that arrives as its
    awaited call finishes."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        missed.append(1)
    await asyncio.Event().wait()  # on, until cancelled again


def test_a_task_that_missed_its_cancel_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.01)

    async def scenario() -> None:
        missed: list[int] = []
        task = asyncio.create_task(misses_one_cancel(missed))
        await asyncio.sleep(0)
        await asyncio.wait_for(stop_task(task), timeout=10)
        assert missed == [1], "the first cancel was lost"
        assert task.cancelled()

    asyncio.run(scenario())


def test_a_task_that_will_not_end_is_left_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.01)

    async def scenario() -> None:
        release = asyncio.Event()
        cancels: list[int] = []

        async def stubborn() -> None:
            while not release.is_set():
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancels.append(1)

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(stop_tasks([task], timeout_s=0.2), timeout=10)
        assert not task.done(), "returned at the bound, the task still running"
        assert len(cancels) >= 2, "cancelled again while it ran"
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_errors_are_logged_and_the_caller_is_not_waited_for() -> None:
    async def scenario() -> None:
        async def fails() -> None:
            raise ValueError("broken loop")

        failed = asyncio.create_task(fails(), name="broken")
        sleeping = asyncio.create_task(asyncio.sleep(30))
        await asyncio.sleep(0)
        with capture_logs() as logs:
            # The calling task is among those named: it is not cancelled or waited for.
            current = asyncio.current_task()
            assert current is not None
            await stop_tasks([failed, sleeping, current])
            await stop_task(None)
        assert sleeping.cancelled()
        assert [(e["event"], e["task"], e["error"]) for e in logs] == [
            ("a background task had failed", "broken", "ValueError('broken loop')")
        ]

    asyncio.run(scenario())
