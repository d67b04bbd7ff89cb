"""Pipelined writes to Redis: one round trip for every message waiting to go out.

A worker streams chunks of many requests at once; one round trip each costs it (and Redis) a system
call pair and a connection checkout per chunk. Here each call waits in a queue; one sender task takes
everything queued and sends it as one non-transactional pipeline. An idle publisher sends a lone message
at once, so the first token is not delayed; under load, messages that arrive during a round trip go
together in the next one. Order is kept (one sender, FIFO), so per-channel order holds.

Two kinds of call share the queue: a plain PUBLISH, and a short run of commands (a worker's chunk:
plumbing.protocol.request.chunk_commands) whose last reply is the call's. A run's commands go out
together, in order, in the batch's pipeline; a run any of whose commands failed raises what failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from plumbing.tasks import stop_task

MAX_BATCH = 256

Arg = str | bytes | int | float


Command = Sequence[Arg]


@dataclass(slots=True)
class _Call:
    commands: Sequence[Command]  # the last one's reply is the call's
    done: asyncio.Future[Any]


class PipelinedPublisher:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._queue: list[_Call] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        self.published = 0

    async def publish(self, channel: str, message: bytes) -> None:
        """Return when the message is published; raise what Redis raised for its batch."""
        await self._enqueue(_Call((("PUBLISH", channel, message),), self._future()))

    async def run(self, commands: Sequence[Command]) -> Any:
        """Send `commands` together, in order; the last one's reply, or what Redis raised for any."""
        assert commands, "a run needs a command"
        return await self._enqueue(_Call(commands, self._future()))

    async def close(self) -> None:
        await stop_task(self._task)
        _fail(self._queue, ConnectionError("publisher closed"))
        self._queue.clear()

    @staticmethod
    def _future() -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()

    async def _enqueue(self, call: _Call) -> Any:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send_forever())
        self._queue.append(call)
        self._wake.set()
        return await call.done

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                await self._send(batch)

    async def _send(self, batch: list[_Call]) -> None:
        try:
            results = await self._execute(batch)
        except Exception as exc:  # every waiter of this batch sees the failure, as a lone call would
            _fail(batch, exc)
            return
        except asyncio.CancelledError:
            _fail(batch, ConnectionError("publisher closed"))
            raise
        self.round_trips += 1
        self.published += len(batch)
        for call, result in zip(batch, results, strict=True):
            if call.done.done():
                continue
            if isinstance(result, Exception):
                call.done.set_exception(result)
            else:
                call.done.set_result(result)

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        """Each call's reply: its last command's, or the first exception among its commands."""
        if len(batch) == 1 and len(batch[0].commands) == 1 and batch[0].commands[0][0] == "PUBLISH":
            _, channel, message = batch[0].commands[0]
            return [await self._redis.publish(str(channel), message)]
        # execute_command, not publish(): a cluster client refuses it by name in a pipeline, though it
        # routes it, and sends each node's share as one.
        async with self._redis.pipeline(transaction=False) as pipe:
            for call in batch:
                for command in call.commands:
                    pipe.execute_command(*command)
            replies = list(await pipe.execute(raise_on_error=False))
        results: list[Any] = []
        at = 0
        for call in batch:
            mine = replies[at : at + len(call.commands)]
            at += len(call.commands)
            failed = [reply for reply in mine if isinstance(reply, Exception)]
            results.append(failed[0] if failed else mine[-1])
        return results


def _fail(batch: list[_Call], exc: BaseException) -> None:
    for call in batch:
        if not call.done.done():
            call.done.set_exception(exc)
