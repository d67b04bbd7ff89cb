"""The loop-busy histogram counts a callback that holds the loop's CPU, and not a thread that waits."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from plumbing.loop_busy import busy_between, watch_loop_busy

HELD_S = 0.3


def ticks_over(bound: str) -> float:
    count = REGISTRY.get_sample_value("sluice_event_loop_busy_cpu_seconds_count") or 0.0
    under = REGISTRY.get_sample_value("sluice_event_loop_busy_cpu_seconds_bucket", {"le": bound}) or 0.0
    return count - under


def hold_cpu(seconds: float) -> None:
    """Spin until this thread has used `seconds` of CPU time, however long that takes on a busy host."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


async def watched(block: float, spin: bool) -> float:
    """Ticks over 0.25 s of loop CPU while the loop is held `block` seconds, spinning or asleep."""
    watch = asyncio.create_task(watch_loop_busy())
    await asyncio.sleep(0.1)  # a few ticks first
    before = ticks_over("0.25")
    if spin:
        hold_cpu(block)
    else:
        time.sleep(block)  # noqa: ASYNC251 - holding the loop without CPU is the point
    await asyncio.sleep(0.1)
    watch.cancel()
    return ticks_over("0.25") - before


def test_a_callback_that_spins_is_counted_once() -> None:
    assert asyncio.run(watched(HELD_S, spin=True)) == 1


def test_a_loop_thread_that_waits_without_cpu_is_not_counted() -> None:
    # Waiting stands for a thread with no core or no interpreter lock: wall time passes, CPU time does not.
    assert asyncio.run(watched(HELD_S, spin=False)) == 0


def test_busy_between_never_goes_negative() -> None:
    assert busy_between(2.0, 2.5) == 0.5
    assert busy_between(2.5, 2.0) == 0.0
