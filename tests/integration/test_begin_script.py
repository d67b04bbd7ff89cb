"""What decides who may write a request's stream, against the real Redis-compatible server: the start
check and the first chunk are one script, so a request that may not start on this worker publishes
nothing; a move goes ahead only while the log is as the dispatcher read it, and starts a writer epoch
that fences the lost worker's later chunks out of what is read and relayed."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from dispatcher.acts import Acts
from dispatcher.hold import Held
from dispatcher.placement import Decision
from dispatcher.settings import DispatcherSettings
from gpu_workers.starting import STARTED_MARK_TTL_MS
from plumbing.clients import redis_client
from plumbing.protocol.request import BEGIN_SCRIPT, END_SCRIPT, chunk_commands, end_args, still_owner
from plumbing.publisher import PipelinedPublisher
from plumbing.replay import read_log, read_log_state
from queue_schemas.codec import decode_channel_message, encode
from queue_schemas.messages import FinalChunk, FinishReason, MoveMark, TokenChunk, Usage
from tests.conftest import Bus
from tests.integration.helpers import make_request

pytestmark = pytest.mark.timeout(60)


async def test_the_first_chunk_goes_out_only_with_a_successful_start(bus: Bus) -> None:
    names = bus.settings().names
    redis = redis_client(bus.settings())
    listener = aioredis.Redis.from_url(bus.redis_url)
    pubsub = listener.pubsub()
    begin = redis.register_script(BEGIN_SCRIPT)

    async def start(rid: str, worker: str) -> str:
        keys = [names.cancelled(rid), names.placement(rid), names.started(rid), names.replay(rid)]
        keys.append(names.stream_channel(rid))
        args: list[str | bytes | int] = [worker, STARTED_MARK_TTL_MS, "PUBLISH"]
        args += [f"first of {rid}".encode(), 0, 60_000]
        outcome = await begin(keys=keys, args=args)
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    try:
        await pubsub.subscribe(*(names.stream_channel(rid) for rid in ("ok", "gone", "moved")))
        for _ in range(3):
            await pubsub.get_message(timeout=2)  # subscribe confirmations
        await redis.set(names.placement("ok"), "w1")
        await redis.set(names.placement("gone"), "w1")
        await redis.set(names.cancelled("gone"), "1")
        await redis.set(names.placement("moved"), "w2")

        assert await start("gone", "w1") == "cancelled"
        assert await start("moved", "w1") == "moved"
        assert await start("ok", "w1") == "ok"
        assert await redis.get(names.started("ok")) == b"w1"
        assert await redis.get(names.started("moved")) is None
        assert await redis.get(names.started("gone")) is None

        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert message is not None
        assert (message["channel"], message["data"]) == (names.stream_channel("ok").encode(), b"first of ok")
        assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5) is None
        assert await redis.hgetall(names.replay("ok")) == {b"0": b"first of ok"}, "logged as published"
        assert not await redis.exists(names.replay("moved"), names.replay("gone"))

        # Without a channel (a batch request) the script only marks the start.
        batch_keys = [names.cancelled("b"), names.placement("b"), names.started("b"), names.replay("b")]
        assert await begin(keys=batch_keys, args=["w1", STARTED_MARK_TTL_MS]) == b"ok"
        assert await redis.get(names.started("b")) == b"w1"
        assert not await redis.exists(names.replay("b"))
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await redis.aclose()


async def test_a_move_needs_the_log_as_it_was_read_and_fences_the_lost_worker_by_epoch(bus: Bus) -> None:
    settings = bus.settings(DispatcherSettings)
    assert isinstance(settings, DispatcherSettings)
    names = settings.names
    rid = "fenced-01"
    redis = redis_client(settings)
    publisher = PipelinedPublisher(redis)
    listener = aioredis.Redis.from_url(bus.redis_url)
    pubsub = listener.pubsub()

    async def write(worker: str, epoch: int, seq: int) -> bool:
        """As a worker writes a chunk; whether the request is still at the worker's epoch."""
        event = TokenChunk(
            request_id=rid, seq=seq, text=f"{worker}:{seq}", num_tokens=1, token_ids=(seq,), epoch=epoch
        )
        commands = chunk_commands(names, event, encode(event), epoch, 60_000, "PUBLISH")
        return still_owner(await publisher.run(commands), epoch)

    async def end(epoch: int, seq: int) -> int:
        """As a worker writes its final chunk."""
        usage = Usage(prompt_tokens=1, completion_tokens=seq + 1)
        final = FinalChunk(
            request_id=rid, seq=seq, finish_reason=FinishReason.STOP, usage=usage, worker_id="w", epoch=epoch
        )
        keys, args = end_args(names, final, encode(final), epoch, 5_000, "PUBLISH")
        return int(await publisher.run([("EVAL", END_SCRIPT, len(keys), *keys, *args)]))

    try:
        await pubsub.subscribe(names.stream_channel(rid))
        confirmed = await pubsub.get_message(timeout=1)
        assert confirmed is not None
        assert confirmed["type"] == "subscribe"
        await redis.set(names.placement(rid), "w1")
        assert [await write("w1", 0, 0), await write("w1", 0, 1)] == [True, True]
        # A dispatcher decided to move the request after reading two chunks; the old owner wrote a
        # third meanwhile: the move does not go ahead, and is decided again from the longer log.
        stale = await read_log_state(redis, names, rid)
        assert await write("w1", 0, 2)
        request = make_request("sim", rid)
        held = Held(request, None, None, 0.0, moved_from="w1", taken_over=request)
        acts = Acts(redis, settings, None, "d")  # no producer: placing never dead-letters
        decision = Decision("w2")
        assert await acts.place(held, decision, stale) == "changed"
        assert await redis.get(names.placement(rid)) == b"w1", "a refused move changes nothing"
        log = await read_log_state(redis, names, rid)
        assert (len(log.events), log.fields, log.epoch) == (3, 3, 0)
        assert await acts.place(held, decision, log) == "placed"
        assert held.request.epoch == 1, "the new worker writes under the next epoch"
        assert await redis.get(names.placement(rid)) == b"w2"
        # The old owner, presumed lost but still running, writes seq 3 once more: it learns it was
        # moved, and what it wrote is never read; its end is not written at all.
        assert not await write("w1", 0, 3)
        assert await end(0, 4) == 0
        ttl = await redis.pttl(names.replay(rid))
        assert ttl > 5_000, "the lost worker's end did not cut the log's life short"
        assert await write("w2", 1, 3)
        assert await write("w2", 1, 4)
        logged = await read_log(redis, names, rid)
        texts = [e.text for e in logged if isinstance(e, TokenChunk)]
        assert texts == ["w1:0", "w1:1", "w1:2", "w2:3", "w2:4"]
        # On the channel: the move's mark comes before anything written after it, so a relay that
        # has seen it drops the old epoch's late chunk.
        seen = []
        while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)) is not None:
            seen.append(decode_channel_message(message["data"]))
        marks = [m for m in seen if isinstance(m, MoveMark)]
        assert marks == [MoveMark(request_id=rid, epoch=1, seq=3)]
        after = seen[seen.index(marks[0]) + 1 :]
        assert not any(isinstance(m, FinalChunk) for m in after), "the lost worker's end never went out"
        assert [(m.epoch, m.seq) for m in after if isinstance(m, TokenChunk)] == [(0, 3), (1, 3), (1, 4)]
        # A second move starts epoch 2 where the log had reached.
        await redis.set(names.placement(rid), "w2")
        again = Held(held.request, None, None, 0.0, moved_from="w2", taken_over=held.request)
        assert await acts.place(again, Decision("w3"), await read_log_state(redis, names, rid)) == "placed"
        assert again.request.epoch == 2
        assert (await read_log_state(redis, names, rid)).moves == (3, 5)
        assert not await write("w2", 1, 5), "w2 learns it was moved as w1 did"
        assert await end(2, 5) == 1
        final = (await read_log(redis, names, rid))[-1]
        assert isinstance(final, FinalChunk)
        assert (final.seq, final.epoch) == (5, 2)
    finally:
        await publisher.close()
        await pubsub.aclose()
        await listener.aclose()
        await redis.aclose()
