"""A request whose worker is lost goes on from another worker, through the real broker and Valkey.

The first worker's engine dies part-way through its streams; the second worker was draining while the
requests were placed (so they all started on the first), and is ready again before the death. Every
stream must then read, chunk by chunk, as one uninterrupted run: sequence numbers without a gap or a
repeat, the same text as a request that never moved, one final chunk, and usage that counts the
client's prompt once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from queue_schemas.codec import decode, encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    Heartbeat,
    InferenceRequest,
    StreamEvent,
    TokenChunk,
    WorkerState,
)
from queue_schemas.teams import TeamRecord
from tests.conftest import Bus
from tests.integration.helpers import (
    Pipeline,
    chat,
    collect,
    create_topics,
    make_request,
    pipeline,
    produce,
    read_answers,
    register_signer,
    submission,
    terminals,
    wait_state,
)

pytestmark = pytest.mark.timeout(120)

DYING = SimulatedEngineConfig(ttft_ms=5, token_ms=10, die_after_tokens=30)
HEALTHY = SimulatedEngineConfig(ttft_ms=5, token_ms=10)


def moved(outcome: str) -> float:
    labels = {"pool": "sim", "outcome": outcome}
    return REGISTRY.get_sample_value("sluice_dispatcher_migrations_total", labels) or 0.0


def text_of(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenChunk | FinalChunk))


async def placed_on(p: Pipeline, request_ids: list[str], worker: str) -> None:
    for _ in range(200):
        owners = await p.redis.mget([p.settings.names.placement(r) for r in request_ids])
        if owners == [worker.encode()] * len(request_ids):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not all placed on {worker}: {owners}")


async def stream_through_a_death(
    p: Pipeline, requests: list[InferenceRequest], send: Callable[[], Awaitable[None]] | None = None
) -> dict[str, list[StreamEvent]]:
    """Place `requests` on w0 (w1 draining meanwhile), let w1 back, and gather every stream."""
    names = p.settings.names
    await p.redis.set(names.drain_request("w1"), b"1", ex=60)
    await wait_state(p, "w1", WorkerState.DRAINING)
    ready = asyncio.Event()
    ids = {r.request_id for r in requests}
    gathering = asyncio.create_task(collect(p.redis, p.settings, ids, 60, ready))
    await ready.wait()
    # One batch: w0's engine dies after 30 tokens in all, so every request must be started on it by then.
    topic = names.requests_topic("sim")
    await asyncio.gather(*[await p.producer.send(topic, encode(req), key=b"k") for req in requests])
    await placed_on(p, sorted(ids), "w0")
    await p.redis.delete(names.drain_request("w1"))
    await wait_state(p, "w1", WorkerState.READY)
    return await gathering


async def test_streams_of_a_dead_engine_go_on_from_another_worker_as_one_run(bus: Bus) -> None:
    async with pipeline(bus, engines=[DYING, HEALTHY]) as p:
        before = moved("moved")
        requests = [make_request("sim", f"moving-{i:04d}", max_tokens=40) for i in range(3)]
        streams = await stream_through_a_death(p, requests)
        await wait_state(p, "w0", WorkerState.FAILED)
        raw = await p.redis.get(p.settings.names.heartbeat("sim", "w0"))
        assert raw is not None
        assert "died" in (decode(Heartbeat, raw).error or ""), "the failed worker says why"
        reference = make_request("sim", "never-moved-0001", max_tokens=40)  # the same prompt, on w1 alone
        ready = asyncio.Event()
        gathering = asyncio.create_task(collect(p.redis, p.settings, {reference.request_id}, 30, ready))
        await ready.wait()
        await p.producer.send_and_wait(p.settings.names.requests_topic("sim"), encode(reference), key=b"k")
        expected = (await gathering)[reference.request_id]
        assert isinstance(expected[-1], FinalChunk)
        assert expected[-1].worker_id == "w1"

        assert moved("moved") - before == 3, "each stream moved once"
        for rid, events in streams.items():
            assert [type(e) for e in terminals(events)] == [FinalChunk], (rid, events)
            assert [e.seq for e in events] == list(range(len(events))), "no gap, no repeat"
            assert text_of(events) == text_of(expected), rid
            final = events[-1]
            assert isinstance(final, FinalChunk)
            assert final.worker_id == "w1"
            assert final.usage.prompt_tokens == 50, "the prompt counts once"
            assert final.usage.completion_tokens == len(text_of(events)) == 40
            assert final.finish_reason == expected[-1].finish_reason
            assert any(isinstance(e, TokenChunk) for e in events[:-1]), "w0 had sent some of it"


async def test_a_request_that_cannot_resume_exactly_ends_with_worker_lost(bus: Bus) -> None:
    async with pipeline(bus, engines=[DYING, HEALTHY]) as p:
        before = moved("refused")
        plain = make_request("sim", "stop-seq-req-0001", max_tokens=40)
        with_stop = plain.model_copy(
            update={"sampling": plain.sampling.model_copy(update={"stop": ("zzz",)})}
        )
        streams = await stream_through_a_death(p, [with_stop])
        events = streams[with_stop.request_id]
        end = terminals(events)
        assert len(end) == 1, events
        assert isinstance(end[0], ErrorChunk)
        assert end[0].code == "worker_lost"
        assert "stop sequences" in end[0].message
        assert end[0].seq == len(events) - 1, "the error follows the chunks already sent"
        assert moved("refused") - before == 1


async def test_past_the_pools_migration_limit_a_request_ends_with_worker_lost(
    bus: Bus, tmp_path: Path
) -> None:
    config = tmp_path / "pools.toml"
    config.write_text('[[pools]]\nname = "sim"\nmodel = "sluice-sim"\nmax_migrations = 0\n')
    async with pipeline(bus, engines=[DYING, HEALTHY], config=config) as p:
        req = make_request("sim", "no-moves-allowed-01", max_tokens=40)
        events = (await stream_through_a_death(p, [req]))[req.request_id]
        end = terminals(events)
        assert len(end) == 1, events
        assert isinstance(end[0], ErrorChunk)
        assert end[0].code == "worker_lost"
        assert "already moved 0 times" in end[0].message


async def test_a_batch_request_moves_instead_of_starting_again(bus: Bus) -> None:
    async with pipeline(bus, engines=[DYING, HEALTHY]) as p:
        names = p.settings.names
        reply = f"answers.{names.prefix}.moved"
        record = TeamRecord(team="acme", reply_prefixes=(f"answers.{names.prefix}.",))
        await p.redis.set(names.team("acme"), record.model_dump_json())
        acme = await register_signer(p.redis, names, "acme")
        await create_topics(p.settings, reply, partitions=1)
        before = moved("moved")
        await p.redis.set(names.drain_request("w1"), b"1", ex=60)
        await wait_state(p, "w1", WorkerState.DRAINING)
        first = submission("batch-moves-1", chat("carry on", max_tokens=60), reply_topic=reply)
        await produce(p.settings, [(names.batch_topic("sim"), json.dumps(first).encode())], acme)
        await wait_until_started(p, names.started, "w0")
        await p.redis.delete(names.drain_request("w1"))
        [answer] = await read_answers(p.settings.kafka_bootstrap, reply, 1, 40)
        again = submission("batch-moves-2", chat("carry on", max_tokens=60), reply_topic=reply)
        await produce(p.settings, [(names.batch_topic("sim"), json.dumps(again).encode())], acme)
        answers = await read_answers(p.settings.kafka_bootstrap, reply, 2, 40)
        reference = next(a for a in answers if a["custom_id"] == "batch-moves-2")

        assert answer["custom_id"] == "batch-moves-1"
        assert moved("moved") - before == 1
        body, expected = answer["response"]["body"], reference["response"]["body"]
        assert answer["response"]["status_code"] == 200, answer
        assert body["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        counted = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: cache state
        assert {k: body["usage"][k] for k in counted} == {k: expected["usage"][k] for k in counted}


async def wait_until_started(p: Pipeline, started: Callable[[str], str], worker: str) -> None:
    """Until some request's started mark names `worker` (the batch request id is the dispatcher's)."""
    for _ in range(300):
        keys = [k async for k in p.redis.scan_iter(match=started("*"))]
        if keys and worker.encode() in await p.redis.mget(keys):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"nothing started on {worker}")
