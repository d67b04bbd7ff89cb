"""Pipelined writes to Redis: one round trip for every message waiting to go out.

A worker streams chunks of many requests at once; one round trip each costs it (and Redis) a system
call pair and a connection checkout per chunk. Here each call waits in a queue; one sender task takes
everything queued and sends it as one non-transactional pipeline. An idle publisher sends a lone message
at once, so the first token is not delayed; under load, messages that arrive during a round trip go
together in the next one. Order is kept (one sender, FIFO), so per-channel order holds.

Two kinds of call share the queue: a plain PUBLISH, and a run of the publisher's script (EVALSHA; a
server that lost its script cache, after a restart, gets it loaded again and the calls retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

MAX_BATCH = 256

Arg = str | bytes | int | float


@dataclass(slots=True)
class _Call:
    channel: str  # PUBLISH when set, else the script
    message: bytes
    keys: Sequence[str]
    args: Sequence[Arg]
    done: asyncio.Future[Any]


class PipelinedPublisher:
    def __init__(self, redis: aioredis.Redis, script: str | None = None) -> None:
        self._redis = redis
        self._script = script
        self._sha = hashlib.sha1(script.encode()).hexdigest() if script else ""
        self._queue: list[_Call] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        self.published = 0

    async def publish(self, channel: str, message: bytes) -> None:
        """Return when the message is published; raise what Redis raised for its batch."""
        await self._enqueue(_Call(channel, message, (), (), self._future()))

    async def run(self, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run the publisher's script; its reply, or what Redis raised."""
        assert self._script is not None, "this publisher has no script"
        return await self._enqueue(_Call("", b"", keys, args, self._future()))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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
            missing = [c for c, r in zip(batch, results, strict=True) if isinstance(r, NoScriptError)]
            if missing:  # the server restarted since the script was loaded
                assert self._script is not None
                await self._redis.script_load(self._script)
                retried = dict(zip(map(id, missing), await self._execute(missing), strict=True))
                results = [retried.get(id(c), r) for c, r in zip(batch, results, strict=True)]
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
        if len(batch) == 1 and batch[0].channel:
            return [await self._redis.publish(batch[0].channel, batch[0].message)]
        # execute_command, not publish()/evalsha(): a cluster client refuses those two by name in a
        # pipeline, though it routes them (EVALSHA by its keys) and sends each node's share as one.
        async with self._redis.pipeline(transaction=False) as pipe:
            for call in batch:
                if call.channel:
                    pipe.execute_command("PUBLISH", call.channel, call.message)
                else:
                    pipe.execute_command("EVALSHA", self._sha, len(call.keys), *call.keys, *call.args)
            return list(await pipe.execute(raise_on_error=False))


def _fail(batch: list[_Call], exc: BaseException) -> None:
    for call in batch:
        if not call.done.done():
            call.done.set_exception(exc)
