"""Taking requests from the worker's inbox: entries read, checked and held until a slot frees (the best
of them starts, not the oldest), duplicates dropped, cancellations applied, and draining."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from gpu_workers.inbox import Entry
from gpu_workers.parts import CONSUME_ROUND_S, INBOX_ITEMS, INBOX_LOOP, REQUEST_ITEMS, log
from gpu_workers.serving import Serving
from plumbing.health import item_failed
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import (
    CancelNotice,
    InferenceRequest,
)
from queue_schemas.names import INBOX_FIELD


class Consuming(Serving):
    async def _consume(self, until: Callable[[], bool]) -> None:
        """Receive: keep up to max_running requests going until `until()` says stop, and the light slots
        for teams under their share; read ahead up to `inbox_lookahead` entries, and start the best of
        what was read first. One inbox read is outstanding at a time and is never cancelled (entries it
        returns are ours to start or leave unacknowledged); a request that ends wakes the loop at once."""
        reader: asyncio.Task[list[Entry]] | None = None
        try:
            while not until():
                self.liveness.beat(INBOX_LOOP)
                self._start_ready()
                read_ahead = self.max_running + self.settings.inbox_lookahead - len(self._tasks)
                room = read_ahead - len(self.slots.ready)
                if reader is None and room > 0:
                    reader = asyncio.create_task(self.inbox.read(room, block_ms=200), name="inbox-read")
                waiting: set[asyncio.Future[Any]] = set(self._tasks.values())
                if reader is not None:
                    waiting.add(reader)
                if not waiting:  # no room to read ahead and nothing running: cannot happen with slots
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=CONSUME_ROUND_S)
                if reader is not None and reader.done():
                    await self._take(reader)
                    reader = None
        finally:
            if reader is not None:
                await asyncio.wait({reader}, timeout=1.0)
                if reader.done():
                    await self._take(reader)
                else:
                    reader.cancel()  # shutdown: unacknowledged entries stay for a dispatcher to move

    async def _take(self, reader: asyncio.Task[list[Entry]]) -> None:
        try:
            entries = reader.result()
        except RedisError as exc:
            log.warning("inbox read failed", error=str(exc))
            await asyncio.sleep(0.5)
            return
        for entry_id, fields in entries:
            try:
                self._accept(entry_id, fields)
            except Exception:  # an entry this worker cannot take: it is dropped alone
                self._drop_entry(entry_id, "the entry could not be taken", exc_info=True)
        self._inbox_seen_empty = not entries and not self.slots.ready

    def _start_ready(self) -> None:
        """Fill free slots from the ready entries (`Slots.next` says which each takes)."""
        while (ready := self.slots.next(len(self._tasks))) is not None:
            self._start(ready.request, ready.entry_id)

    def _accept(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode(InferenceRequest, fields.get(INBOX_FIELD, b""))
        except SchemaError as exc:
            self._drop_entry(entry_id, str(exc))
            return
        rid = request.request_id
        if rid in self._tasks or self.slots.knows(rid):
            return
        if self.slots.finished(rid):  # appended again by a dispatcher that could not know it had arrived
            self._spawn(entry_id.decode(), self._ack(entry_id))
            return
        self.slots.wait(request, entry_id)
        self.first_tokens.arrived(request, time.time())

    def _drop_entry(self, entry_id: bytes, reason: str, exc_info: bool = False) -> None:
        item_failed(INBOX_ITEMS)
        key = entry_id.decode(errors="replace")
        log.error("poison inbox entry dropped", entry=key, reason=reason, exc_info=exc_info)
        self._spawn(key, self._ack(entry_id))

    def _start(self, request: InferenceRequest, entry_id: bytes) -> None:
        self.slots.started(request)
        self.first_tokens.started(request.request_id, time.time())
        self._spawn(request.request_id, self._serve(request, entry_id))

    def _spawn(self, key: str, coro: Any) -> None:
        task = asyncio.create_task(coro, name=f"serve-{key}")
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._ended(key, t))

    def _ended(self, key: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Raised past its own handling (acknowledging, releasing): the entry stays for recovery.
            item_failed(REQUEST_ITEMS)
            log.error("request task failed", key=key, exc_info=task.exception())
        self._tasks.pop(key, None)
        self.slots.ended(key)
        self.first_tokens.ended(key, time.time())
        self._beat_soon.set()

    def _on_cancel(self, data: bytes) -> None:
        try:
            notice = decode(CancelNotice, data)
        except SchemaError as exc:
            log.warning("bad cancel notice", reason=str(exc))
            return
        task = self._tasks.get(notice.request_id)
        if task is not None:
            log.info("cancelling request", request_id=notice.request_id, reason=notice.reason)
            task.cancel()
