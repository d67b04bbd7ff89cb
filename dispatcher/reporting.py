"""What a dispatcher tells the scaler through Redis, once a second.

- how many interactive requests it holds (`held:<pool>:<dispatcher>`, expiring, so a dead dispatcher
  stops counting and the key's presence says the group has a live consumer);
- the high watermark of each partition it owns, as fetch responses report it: right even where a
  broker's ListOffsets undercounts.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from queue_schemas.messages import Priority

if TYPE_CHECKING:
    from dispatcher.service import Dispatcher

HELD_TTL_MS = 3000
HIGHWATER_TTL_MS = 5000


async def report_loop(d: Dispatcher, stop: asyncio.Event) -> None:
    key = d.names.held(d.pool, d.consumer_id)
    while not stop.is_set():
        marks: dict[str, dict[Any, Any]] = {d.topic: {}, d.batch_topic: {}}
        for tp in d.consumer.assignment():
            mark = d.consumer.highwater(tp)
            if tp.topic in marks and mark is not None:
                marks[tp.topic][str(tp.partition)] = mark
        with contextlib.suppress(RedisError):
            async with d.redis.pipeline(transaction=False) as pipe:
                # Interactive only: admission control and scaling answer to interactive demand, and a
                # batch backlog waits in its own hold and topic for the room interactive load leaves.
                pipe.set(key, d.hold.size(Priority.INTERACTIVE), px=HELD_TTL_MS)
                for topic, marks_key in (
                    (d.topic, d.names.highwater(d.pool)),
                    (d.batch_topic, d.names.batch_highwater(d.pool)),
                ):
                    if marks[topic]:
                        pipe.hset(marks_key, mapping=marks[topic])
                        pipe.pexpire(marks_key, HIGHWATER_TTL_MS)
                await pipe.execute()
        await asyncio.sleep(1.0)
    with contextlib.suppress(RedisError):
        await d.redis.delete(key)
