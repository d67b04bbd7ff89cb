"""How long the event loop's thread works between two of its own ticks, in CPU seconds, and how late the
ticks come, in wall seconds.

A callback that holds the loop (a large body parsed inline) shows as one long stretch of the loop thread's
CPU time between two ticks of a task that only sleeps. CPU time, unlike wall time, does not grow while the
thread waits for a core or for the interpreter lock, so a busy machine does not look like a blocked loop:
`sluice_event_loop_busy_cpu_seconds` separates "this process held its streams" from "the host is short of
cores". A loop held without using CPU (a blocking call on the loop) shows only in the wall-clock lateness,
`sluice_event_loop_lag_seconds`, which a host short of cores inflates too.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

TICK_S = 0.02

LOOP_BUSY = Histogram(
    "sluice_event_loop_busy_cpu_seconds",
    f"CPU time of the event loop's thread between two {TICK_S * 1000:.0f} ms ticks; far above the tick means "
    "one callback held the loop",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
LOOP_LAG = Histogram(
    "sluice_event_loop_lag_seconds",
    f"How late each {TICK_S * 1000:.0f} ms tick of the event loop came, in wall time (a held loop, or a "
    "busy host)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def busy_between(previous_cpu_s: float, now_cpu_s: float) -> float:
    """The loop thread's CPU seconds from one tick to the next (never negative)."""
    return max(0.0, now_cpu_s - previous_cpu_s)


async def watch_loop(tick_s: float = TICK_S) -> None:
    """Observe each tick's loop CPU time into LOOP_BUSY and its lateness into LOOP_LAG, until cancelled.
    Runs on the loop, so the thread's own CPU clock is the loop's."""
    previous_cpu = time.thread_time()
    while True:
        asked = time.monotonic()
        await asyncio.sleep(tick_s)
        now_cpu = time.thread_time()
        LOOP_LAG.observe(max(0.0, time.monotonic() - asked - tick_s))
        LOOP_BUSY.observe(busy_between(previous_cpu, now_cpu))
        previous_cpu = now_cpu
