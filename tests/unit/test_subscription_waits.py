"""A subscription's waits (ingress.streams.Subscription): messages in order, one deadline timer for
all of a stream's waits (set again if it fires early), the hub's failure handed to the reader, and the
timer gone and a waiting reader ended once closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from ingress.streams import HubDisconnected, StreamHub, Subscription


def subscription() -> Subscription:
    return Subscription(StreamHub(aioredis.Redis(), "control"), b"c")


async def test_messages_come_in_order_whether_at_hand_or_waited_for() -> None:
    sub = subscription()
    sub.deliver(b"1")
    assert sub.ready()
    assert await sub.next(time.time() + 5) == b"1"
    assert not sub.ready()
    waiting = asyncio.create_task(sub.next(time.time() + 5))
    await asyncio.sleep(0)
    assert not waiting.done()
    sub.deliver(b"2")
    sub.deliver(b"3")
    assert await waiting == b"2"
    assert await sub.next(time.time() + 5) == b"3"


async def test_the_deadline_ends_a_wait_with_nothing_received() -> None:
    sub = subscription()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await sub.next(time.time() + 0.2)
    assert time.monotonic() - started >= 0.15
    with pytest.raises(TimeoutError):  # a deadline already past: no wait at all
        await sub.next(time.time() - 1)


async def test_a_message_at_hand_is_returned_after_the_deadline() -> None:
    sub = subscription()
    sub.deliver(b"late")
    assert await sub.next(time.time() - 1) == b"late"


async def test_one_timer_serves_every_wait_for_the_same_deadline_and_close_cancels_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    scheduled: list[asyncio.TimerHandle] = []
    call_later = loop.call_later

    def counted(delay: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        scheduled.append(call_later(delay, callback))
        return scheduled[-1]

    monkeypatch.setattr(loop, "call_later", counted)
    sub = subscription()
    deadline = time.time() + 60
    for n in range(20):
        waiting = asyncio.create_task(sub.next(deadline))
        await asyncio.sleep(0)
        sub.deliver(str(n).encode())
        assert await waiting == str(n).encode()
    assert len(scheduled) == 1, "the stream's deadline is one timer, not one per wait"
    assert not scheduled[0].cancelled()
    await sub.close()
    assert scheduled[0].cancelled()


async def test_the_hubs_failure_reaches_a_waiting_reader() -> None:
    sub = subscription()
    waiting = asyncio.create_task(sub.next(time.time() + 5))
    await asyncio.sleep(0)
    sub.fail(HubDisconnected("lost"))
    with pytest.raises(HubDisconnected, match="lost"):
        await waiting
    assert sub.failed


async def test_a_cancelled_wait_leaves_the_subscription_usable() -> None:
    sub = subscription()
    waiting = asyncio.create_task(sub.next(time.time() + 5))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    sub.deliver(b"after")
    assert await sub.next(time.time() + 5) == b"after"


async def test_closing_ends_a_waiting_reader_and_any_later_wait() -> None:
    sub = subscription()
    waiting = asyncio.create_task(sub.next(time.time() + 60))
    await asyncio.sleep(0)
    await sub.close()
    with pytest.raises(HubDisconnected, match="closed"):
        await asyncio.wait_for(waiting, 1)
    with pytest.raises(HubDisconnected, match="closed"):
        await sub.next(time.time() + 60)


async def test_a_timer_that_fires_before_the_deadline_by_the_wall_clock_is_set_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timer runs on the loop's monotonic clock, the deadline is wall-clock time: a wall clock set
    back while the stream waits makes the timer fire early, and the wait goes on to the deadline (a
    generous bound: without a new timer the wait would never end)."""
    import ingress.streams as streams

    behind = 0.0
    real = time.time
    monkeypatch.setattr(streams, "time", SimpleNamespace(time=lambda: real() - behind))
    sub = subscription()
    deadline = real() + 0.1
    waiting = asyncio.create_task(sub.next(deadline))
    await asyncio.sleep(0)
    behind = 0.2  # the wall clock stepped back: the timer's 0.1 s leave 0.2 s to the deadline
    await asyncio.sleep(0.15)
    assert not waiting.done(), "woken early, it waits again"
    await asyncio.wait({waiting}, timeout=2)
    assert waiting.done(), "and the timer is set again for what is left"
    assert isinstance(waiting.exception(), TimeoutError)
