"""The loop watch: a callback that spins on the loop counts in loop CPU time; a loop thread that waits
(for a core, the interpreter lock, or a blocking call) counts only in the wall-clock lag."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from plumbing.loop_watch import busy_between, watch_loop

HELD_S = 0.3


def over(metric: str, bound: str) -> float:
    count = REGISTRY.get_sample_value(f"{metric}_count") or 0.0
    return count - (REGISTRY.get_sample_value(f"{metric}_bucket", {"le": bound}) or 0.0)


def hold_cpu(seconds: float) -> None:
    """Spin until this thread has used `seconds` of CPU time, however long that takes on a busy host."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


async def watched(hold: str) -> tuple[float, float]:
    """(ticks after over 0.25 s of loop CPU, ticks over 0.25 s late) while the loop is held `hold`ing."""
    watch = asyncio.create_task(watch_loop())
    await asyncio.sleep(0.1)  # a few ticks first
    busy, lag = "sluice_event_loop_busy_cpu_seconds", "sluice_event_loop_lag_seconds"
    before = over(busy, "0.25"), over(lag, "0.25")
    if hold == "spin":
        hold_cpu(HELD_S)
    elif hold == "sleep":
        time.sleep(HELD_S)  # noqa: ASYNC251 - a blocking call on the loop is the case under test
    else:  # another thread spins Python: the loop thread waits for the interpreter lock, not for its own work
        await asyncio.to_thread(hold_cpu, HELD_S)
    await asyncio.sleep(0.1)
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    return over(busy, "0.25") - before[0], over(lag, "0.25") - before[1]


# Lag counts at least the held tick: a busy host can make another tick late too. Loop CPU counts exactly.


def test_a_callback_that_spins_counts_in_cpu_and_in_lag() -> None:
    busy, lag = asyncio.run(watched("spin"))
    assert busy == 1
    assert lag >= 1


def test_a_blocking_call_on_the_loop_counts_in_lag_only() -> None:
    busy, lag = asyncio.run(watched("sleep"))
    assert busy == 0
    assert lag >= 1


def test_another_thread_holding_the_interpreter_does_not_count_as_loop_cpu() -> None:
    busy, _ = asyncio.run(watched("thread"))
    assert busy == 0


def test_busy_between_never_goes_negative() -> None:
    assert busy_between(2.0, 2.5) == 0.5
    assert busy_between(2.5, 2.0) == 0.0
