"""How long the event loop's thread works between two of its own ticks, in CPU seconds.

A callback that holds the loop (a large body parsed inline, a blocking call) shows as one long stretch of the
loop thread's CPU time between two ticks of a task that only sleeps. CPU time, unlike wall time, does not grow
while the thread waits for a core or for the interpreter lock, so a busy machine does not look like a blocked
loop: `sluice_event_loop_busy_cpu_seconds` separates "this process blocked its streams" from "the host is
short of cores".
"""

from __future__ import annotations

import asyncio
import threading
import time

from prometheus_client import Histogram

TICK_S = 0.02

LOOP_BUSY = Histogram(
    "sluice_event_loop_busy_cpu_seconds",
    f"CPU time of the event loop's thread between two {TICK_S * 1000:.0f} ms ticks; far above the tick means "
    "one callback held the loop",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def busy_between(previous_cpu_s: float, now_cpu_s: float) -> float:
    """The loop thread's CPU seconds from one tick to the next (never negative)."""
    return max(0.0, now_cpu_s - previous_cpu_s)


async def watch_loop_busy(tick_s: float = TICK_S) -> None:
    """Observe the loop thread's CPU time between ticks into LOOP_BUSY, until cancelled. Runs on the loop."""
    clock = time.pthread_getcpuclockid(threading.get_ident())
    previous = time.clock_gettime(clock)
    while True:
        await asyncio.sleep(tick_s)
        now = time.clock_gettime(clock)
        LOOP_BUSY.observe(busy_between(previous, now))
        previous = now
