"""Stored responses against the real Redis-compatible server: a cancel of a request no worker has
started ends its stream at once and keeps any worker from starting it; a cancel of a started one is
left to its worker; the record and its log expire together."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from gpu_workers.starting import STARTED_MARK_TTL_MS
from ingress.responses.events import ResponseRecord
from ingress.responses.store import ResponseStore
from plumbing.clients import redis_client
from plumbing.protocol.request import BEGIN_SCRIPT, begin_keys
from plumbing.replay import read_log
from queue_schemas.codec import encode
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, TokenChunk
from queue_schemas.names import Names
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(60)

KEEP_S = 3600


@dataclass
class Store:
    redis: aioredis.Redis
    names: Names
    store: ResponseStore

    async def saved(self, rid: str) -> ResponseRecord:
        now = time.time()
        record = ResponseRecord(
            request_id=rid, team="t", model="m", created_at=now, deadline=now + 600, prompt_tokens=3,
            background=True,
        )  # fmt: skip
        items = [
            {
                "id": "msg_1",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            }
        ]
        await self.store.save(record, items)
        assert await self.store.input_items(rid) == items
        return record

    async def start(self, rid: str) -> tuple[str, TokenChunk]:
        """A worker's start of the request with its first chunk (gpu_workers' BEGIN_SCRIPT)."""
        first = TokenChunk(request_id=rid, seq=0, text="x", num_tokens=1)
        args: list[str | bytes | int] = ["worker-1", STARTED_MARK_TTL_MS, "PUBLISH", encode(first), 0, 60_000]
        begin = self.redis.register_script(BEGIN_SCRIPT)
        outcome = await begin(keys=begin_keys(self.names, rid), args=args)
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome), first


@pytest.fixture
async def responses(bus: Bus) -> AsyncIterator[Store]:
    settings = bus.settings()
    redis = redis_client(settings)
    yield Store(redis, settings.names, ResponseStore(redis, settings.names, "PUBLISH", KEEP_S))
    await redis.aclose()


async def test_a_cancel_before_the_start_ends_the_stream_and_no_worker_starts_it(responses: Store) -> None:
    redis, names, store = responses.redis, responses.names, responses.store
    rid = "a1" * 16
    record = await responses.saved(rid)
    assert await store.load(rid) == (record, False)

    assert await store.cancel(record) == "ended"
    log = await read_log(redis, names, rid)
    assert len(log) == 1
    assert isinstance(log[0], ErrorChunk)
    assert log[0].code == ErrorCode.CANCELLED
    assert await store.load(rid) == (record, True)
    # Record and log expire together: KEEP_S past the deadline.
    record_ttl = await redis.pttl(names.response(rid))
    log_ttl = await redis.pttl(names.replay(rid))
    assert abs(record_ttl - log_ttl) < 2000
    assert record_ttl > KEEP_S * 1000
    # A worker that took the request meanwhile may not start it.
    assert (await responses.start(rid))[0] == "cancelled"
    assert len(await read_log(redis, names, rid)) == 1


async def test_a_cancel_of_a_started_request_is_left_to_its_worker(responses: Store) -> None:
    redis, names, store = responses.redis, responses.names, responses.store
    rid = "b2" * 16
    record = await responses.saved(rid)
    outcome, first = await responses.start(rid)
    assert outcome == "ok"

    assert await store.cancel(record) == "running"
    assert await read_log(redis, names, rid) == [first]  # the worker logs the end when it stops
    assert await redis.exists(names.cancelled(rid)) == 1
    assert await store.load(rid) == (record, True)

    await store.delete(rid)
    assert await store.load(rid) is None
    assert await read_log(redis, names, rid) == []
