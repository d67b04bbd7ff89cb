"""Placement claims a request on its own keys, then appends it to the worker's inbox (another slot on a
Redis Cluster). A dispatcher that dies between the two leaves a claim without an inbox entry; whoever
reads the record again appends it to the claimed worker, and never places a started request twice."""

from __future__ import annotations

import time

from dispatcher.acts import Acts
from dispatcher.hold import Held
from dispatcher.placement import Decision
from dispatcher.settings import DispatcherSettings
from plumbing.clients import redis_client
from plumbing.replay import LogState
from queue_schemas.codec import decode
from queue_schemas.messages import InferenceRequest
from queue_schemas.names import INBOX_FIELD
from tests.conftest import Bus
from tests.integration.helpers import make_request


async def inbox_ids(acts: Acts, redis: object, worker: str) -> list[str]:
    entries = await redis.xrange(acts.names.inbox(worker), "-", "+")  # type: ignore[attr-defined]
    return [decode(InferenceRequest, fields[INBOX_FIELD]).request_id for _, fields in entries]


async def test_a_claim_without_its_inbox_entry_is_appended_again(bus: Bus) -> None:
    settings = bus.settings(DispatcherSettings, pool="sim")
    assert isinstance(settings, DispatcherSettings)
    redis = redis_client(settings)
    acts = Acts(redis, settings, producer=None, consumer_id="d-test")
    names = settings.names
    try:
        fresh = make_request("sim", "req-two-step-01")
        held = Held(fresh, ("t", 0), 1, time.monotonic())
        assert await acts.place(held, Decision("w1")) == "placed"
        assert await inbox_ids(acts, redis, "w1") == [fresh.request_id]

        # A dispatcher claimed this one for w1 and died before appending it.
        lost = make_request("sim", "req-two-step-02")
        await redis.set(names.placement(lost.request_id), "w1")
        again = Held(lost, ("t", 0), 2, time.monotonic())
        assert await acts.place(again, Decision("w2")) == "redelivered"
        assert await inbox_ids(acts, redis, "w1") == [fresh.request_id, lost.request_id]
        assert await inbox_ids(acts, redis, "w2") == [], "it goes to the worker that holds the claim"

        # Started by its worker (or answered): a redelivery appends nothing.
        await redis.set(names.started(lost.request_id), "w1")
        assert await acts.place(again, Decision("w2")) == "duplicate"
        answered = make_request("sim", "req-two-step-03")
        await redis.set(names.placement(answered.request_id), "w2")
        await redis.set(names.answered(answered.request_id), "1")
        assert await acts.place(Held(answered, None, None, 0.0), Decision("w1")) == "duplicate"
        assert len(await inbox_ids(acts, redis, "w1")) == 2
        assert await inbox_ids(acts, redis, "w2") == []

        # Moved off lost worker w9 (which had started it) and claimed for w3, and the mover died before
        # appending: the next move finds w3's claim, not yet started by w3, and appends it there.
        moved = make_request("sim", "req-two-step-05")
        await redis.set(names.started(moved.request_id), "w9")
        await redis.set(names.placement(moved.request_id), "w3")
        retry = Held(moved, None, None, 0.0, moved_from="w9")
        assert await acts.place(retry, Decision("w4"), LogState([], 0, ())) == "redelivered"
        assert await inbox_ids(acts, redis, "w3") == [moved.request_id]
        await redis.set(names.started(moved.request_id), "w3")
        assert await acts.place(retry, Decision("w4"), LogState([], 0, ())) == "duplicate"

        # Cancelled before placement: no claim, no entry.
        cancelled = make_request("sim", "req-two-step-04")
        await redis.set(names.cancelled(cancelled.request_id), "client")
        assert await acts.place(Held(cancelled, None, None, 0.0), Decision("w1")) == "cancelled"
        assert await redis.get(names.placement(cancelled.request_id)) is None
    finally:
        await redis.aclose()
