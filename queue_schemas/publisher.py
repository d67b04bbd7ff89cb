"""Pub/sub publishing with automatic pipelining: one round trip for every message waiting to go out.

A worker streams chunks of many requests at once; one PUBLISH round trip each costs it (and Redis) a
system call pair and a connection checkout per chunk. Here each `publish` waits in a queue; one sender
task takes everything queued and sends it as one non-transactional pipeline. An idle publisher sends a
lone message at once, so the first token is not delayed; under load, messages that arrive during a round
trip go together in the next one. Order is kept (one sender, FIFO), so per-channel order holds.
"""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

MAX_BATCH = 256


class PipelinedPublisher:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._queue: list[tuple[str, bytes, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        self.published = 0

    async def publish(self, channel: str, message: bytes) -> None:
        """Return when the message is published; raise what Redis raised for its batch."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send_forever())
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((channel, message, done))
        self._wake.set()
        await done

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        _fail(self._queue, ConnectionError("publisher closed"))
        self._queue.clear()

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                await self._send(batch)

    async def _send(self, batch: list[tuple[str, bytes, asyncio.Future[None]]]) -> None:
        try:
            if len(batch) == 1:
                channel, message, _ = batch[0]
                await self._redis.publish(channel, message)
            else:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for channel, message, _ in batch:
                        pipe.publish(channel, message)
                    await pipe.execute()
        except Exception as exc:  # every waiter of this batch sees the failure, as a lone PUBLISH would
            _fail(batch, exc)
            return
        except asyncio.CancelledError:
            _fail(batch, ConnectionError("publisher closed"))
            raise
        self.round_trips += 1
        self.published += len(batch)
        for _, _, done in batch:
            if not done.done():
                done.set_result(None)


def _fail(batch: list[tuple[str, bytes, asyncio.Future[None]]], exc: BaseException) -> None:
    for _, _, done in batch:
        if not done.done():
            done.set_exception(exc)
