"""Where the relay marks that nothing more is at hand (ingress.relay.marked_events): the SSE writer sends
what it made at each mark, so chunks that came together go out in one write and none is held back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import cast

from ingress.relay import FLUSH, Flush, marked_events
from ingress.streams import RESYNC, StreamHub, Subscription
from plumbing.replay import LogState
from queue_schemas.codec import encode
from queue_schemas.messages import FinalChunk, FinishReason, StreamEvent, TokenChunk, Usage

RID = "0123456789abcdef" * 2


class Streamed:
    request_id = RID
    deadline = time.time() + 60


def token(seq: int) -> TokenChunk:
    return TokenChunk(request_id=RID, seq=seq, text=f"t{seq} ", num_tokens=1, token_ids=(seq,))


def final(seq: int) -> FinalChunk:
    usage = Usage(prompt_tokens=1, completion_tokens=seq + 1)
    return FinalChunk(
        request_id=RID,
        seq=seq,
        text="",
        num_tokens=0,
        finish_reason=FinishReason.STOP,
        usage=usage,
        worker_id="w",
    )


async def step(stream: AsyncIterator[StreamEvent | Flush]) -> StreamEvent | Flush:
    """The next item; a relay that waits where it should have marked fails here instead of hanging."""
    return await asyncio.wait_for(anext(stream), 5)


def marks(items: list[StreamEvent | Flush]) -> list[object]:
    return ["FLUSH" if isinstance(i, Flush) else i.seq for i in items]


async def test_chunks_at_hand_go_together_and_a_mark_comes_before_every_wait() -> None:
    sub = Subscription(cast(StreamHub, None), b"ch")
    logged: list[StreamEvent] = [token(0), token(1), token(2), token(3), final(4)]

    async def read_log(request_id: str, from_seq: int) -> LogState:
        return LogState(logged[from_seq:], len(logged), ())

    stream = marked_events(sub, Streamed(), read_log)
    seen: list[StreamEvent | Flush] = []
    sub.deliver(encode(token(0)))
    seen += [await step(stream), await step(stream)]
    assert marks(seen) == [0, "FLUSH"], "the first chunk is marked for sending before the next wait"
    sub.deliver(encode(token(1)))
    sub.deliver(encode(token(1)))  # a repeat: skipped, and it must not hold chunk 1 back
    sub.deliver(RESYNC)
    sub.deliver(encode(token(2)))  # published while the log was read: a repeat once the log has it
    seen = [await step(stream) for _ in range(5)]
    assert marks(seen) == [1, "FLUSH", 2, 3, 4], (
        "a mark before the log is read, then the log's chunks together"
    )
    assert [i async for i in stream] == [], "the final chunk ends the stream"


async def test_a_gap_is_marked_before_the_log_is_read() -> None:
    sub = Subscription(cast(StreamHub, None), b"ch")
    logged: list[StreamEvent] = [token(0), token(1), final(2)]

    async def read_log(request_id: str, from_seq: int) -> LogState:
        return LogState(logged[from_seq:], len(logged), ())

    sub.deliver(encode(token(0)))
    sub.deliver(encode(final(2)))  # chunk 1 was missed
    seen = [item async for item in marked_events(sub, Streamed(), read_log)]
    assert marks(seen) == [0, "FLUSH", 1, 2]
    assert seen[1] is FLUSH
