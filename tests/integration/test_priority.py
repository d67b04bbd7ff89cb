"""Priority and fairness through the real broker and Valkey: the order the dispatcher serves teams, tiers
and classes in, team weights read from the team record, and batch requests that the engine preempts for
interactive ones finishing whole, with usage and charge that match."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gpu_workers.simulated import answer_to, apply_stops
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.codec import decode, decode_stream_event, encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import (
    FinalChunk,
    Heartbeat,
    InferenceRequest,
    Priority,
    StreamEvent,
    Tier,
    TokenChunk,
    WorkerState,
)
from queue_schemas.teams import TeamRecord
from tests.conftest import Bus
from tests.integration.helpers import (
    Pipeline,
    chat,
    create_topics,
    held_requests,
    make_request,
    pipeline,
    produce,
    read_answers,
    register_signer,
    submission,
    wait_state,
)
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(90)

ONE_AT_A_TIME = SimulatedEngineConfig(ttft_ms=5, token_ms=15, max_running=1)
MAX_TOKENS = 200


def request(rid: str, team: str, tier: Tier = Tier.DEFAULT) -> InferenceRequest:
    return make_request("sim", rid, max_tokens=6).model_copy(update={"team": team, "tier": tier})


async def start_order(p: Pipeline, expected: set[str], ready: asyncio.Event, within_s: float) -> list[str]:
    """Request ids in the order their first stream event arrived, until each has its final chunk."""
    order: list[str] = []
    finished: set[str] = set()
    deadline = time.monotonic() + within_s
    async with p.redis.pubsub() as pubsub:
        await pubsub.psubscribe(p.settings.names.stream_channel("*"))
        ready.set()
        while time.monotonic() < deadline and finished != expected:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if msg is None:
                continue
            event: StreamEvent = decode_stream_event(msg["data"])
            if event.request_id not in expected:
                continue
            if event.request_id not in order:
                order.append(event.request_id)
            if not isinstance(event, TokenChunk):
                assert isinstance(event, FinalChunk), event
                finished.add(event.request_id)
    assert finished == expected, f"unfinished: {expected - finished}"
    return order


async def started(p: Pipeline, requests: list[InferenceRequest], count: int) -> bool:
    """Whether the worker has started `count` of `requests`: each has a replay log once its first chunk
    is out."""
    names = p.settings.names
    return int(await p.redis.exists(*(names.replay(r.request_id) for r in requests))) >= count


async def replay_logs(p: Pipeline, count: int) -> bool:
    """Whether `count` requests of this test's names have started (a replay log each)."""
    logs = [key async for key in p.redis.scan_iter(match=p.settings.names.replay("*"))]
    return len(logs) >= count


async def held_while_draining(p: Pipeline, requests: list[InferenceRequest], batch: list[bytes]) -> list[str]:
    """Produce everything while the only worker drains (so all of it waits in the dispatcher's hold), let
    the worker back, and return the order the requests started in."""
    names = p.settings.names
    await p.redis.set(names.drain_request(p.worker_id), b"1", ex=60)
    await wait_state(p, p.worker_id, WorkerState.DRAINING)
    ready = asyncio.Event()
    expected = {r.request_id for r in requests}
    watching = asyncio.create_task(start_order(p, expected, ready, within_s=60))
    await ready.wait()
    for r in requests:  # keyed by team: one partition each, so each team's requests arrive in order
        await p.producer.send_and_wait(names.requests_topic("sim"), encode(r), key=r.team.encode())
    if batch:
        signer = await register_signer(p.redis, names, "acme")
        await produce(p.settings, [(names.batch_topic("sim"), b) for b in batch], signer)
    # Every interactive request received, admitted and held (the dispatcher reports its hold every second,
    # and re-reads team weights every 0.2 s meanwhile) before the worker is back.
    interactive = sum(r.priority is not Priority.BATCH for r in requests)

    async def all_held() -> bool:
        return await held_requests(p, "sim") == interactive

    await eventually(all_held, 30, f"{interactive} requests held")
    await p.redis.delete(names.drain_request(p.worker_id))
    return await watching


async def test_tiers_then_teams_by_tokens_served_then_batch(bus: Bus) -> None:
    async with pipeline(bus, engine=ONE_AT_A_TIME, weights_refresh_s=0.2) as p:
        await create_topics(p.settings, p.settings.names.results_topic("acme"), partitions=1)
        requests = [
            request("flood-000001", "flood"),
            request("flood-000002", "flood"),
            request("flood-000003", "flood"),
            # A flex request no worker can serve within its SLO is refused, not held: with a minute's SLO
            # this one waits its turn behind the held default requests.
            request("flex-0000001", "quiet", Tier.FLEX).model_copy(update={"ttft_slo_ms": 60_000}),
            request("quiet-000001", "quiet"),
            request("urgent-00001", "vip", Tier.PRIORITY),
        ]
        batch = [json.dumps(submission("nightly-1", chat("summarise", max_tokens=4))).encode()]
        order = await held_while_draining(p, requests, batch)
        assert order == [
            "urgent-00001",  # the priority tier first
            "quiet-000001",  # default tier: each team's head in turn, the team with less waiting first
            "flood-000001",
            "flood-000002",  # then the rest of the team with the most tokens served
            "flood-000003",
            "flex-0000001",  # the flex tier after every default request
        ]
        answers = await read_answers(
            p.settings.kafka_bootstrap, p.settings.names.results_topic("acme"), 1, 30
        )
        assert [a["response"]["status_code"] for a in answers] == [200]  # batch last, and answered


async def test_a_worker_starts_the_best_of_the_requests_queued_in_its_inbox(bus: Bus) -> None:
    """Placed on a busy one-slot worker in the worst order: it starts them by tier, then by the fair tag
    the dispatcher gave them, then batch, not first come first served."""
    async with pipeline(bus, engine=ONE_AT_A_TIME) as p:
        names = p.settings.names
        busy = make_request("sim", "busy-0000001", max_tokens=40)
        queued = [
            request("batch-000001", "late").model_copy(update={"priority": Priority.BATCH}),
            request("flex-0000001", "quiet", Tier.FLEX),
            request("flood-000001", "flood").model_copy(update={"fair_tag": 620}),
            request("quiet-000001", "quiet").model_copy(update={"fair_tag": 62}),
            request("urgent-00001", "vip", Tier.PRIORITY),
        ]
        ready = asyncio.Event()
        expected = {r.request_id for r in [busy, *queued]}
        watching = asyncio.create_task(start_order(p, expected, ready, within_s=30))
        await ready.wait()

        async def place(requests: list[InferenceRequest]) -> None:  # as the dispatcher's script does
            async with p.redis.pipeline(transaction=True) as placing:
                for r in requests:
                    placing.set(names.placement(r.request_id), p.worker_id, px=60_000)
                    placing.xadd(names.inbox(p.worker_id), {"m": encode(r)})
                await placing.execute()

        await place([busy])  # it holds the one slot: its first chunk is out
        await eventually(lambda: started(p, [busy], 1), 10, "the busy request started")
        await place(queued)  # at once, so the worker sees all of them whenever the slot frees
        order = await watching
        assert order == [
            "busy-0000001", "urgent-00001", "quiet-000001", "flood-000001", "flex-0000001", "batch-000001",
        ]  # fmt: skip


async def test_batch_requests_placed_past_the_headroom_wait_at_the_worker(bus: Bus) -> None:
    """Six batch requests in the inbox of a four-slot worker (as two dispatchers placing between two
    heartbeats can leave it): the worker runs three (the headroom of 0.25 leaves one slot), so an
    interactive request placed after them starts at once, before the fourth batch request."""
    async with pipeline(bus, engine=SimulatedEngineConfig(ttft_ms=5, token_ms=15, max_running=4)) as p:
        names = p.settings.names
        batch = [
            request(f"batch-00000{i}", "acme").model_copy(
                update={
                    "priority": Priority.BATCH,
                    "sampling": make_request("sim", "x" * 12, max_tokens=40).sampling,
                }
            )
            for i in range(1, 7)
        ]
        urgent = request("urgent-00001", "acme")
        ready = asyncio.Event()
        expected = {r.request_id for r in [*batch, urgent]}
        watching = asyncio.create_task(start_order(p, expected, ready, within_s=30))
        await ready.wait()
        for r in [*batch, urgent]:
            if r is urgent:  # the batch requests hold what they may: three slots of four
                await eventually(lambda: started(p, batch, 3), 10, "three batch requests started")
            await p.redis.set(names.placement(r.request_id), p.worker_id, px=60_000)
            await p.redis.xadd(names.inbox(p.worker_id), {"m": encode(r)})
        order = await watching
        assert set(order[:3]) <= {r.request_id for r in batch}
        assert order[3] == "urgent-00001"


async def test_a_team_of_weight_three_gets_three_turns_for_each_of_a_team_of_weight_one(bus: Bus) -> None:
    async with pipeline(bus, engine=ONE_AT_A_TIME, weights_refresh_s=0.2) as p:
        names = p.settings.names
        await p.redis.set(names.team("gold"), TeamRecord(team="gold", weight=3).model_dump_json())
        requests = []
        for i in range(8):
            requests += [request(f"plain-{i:06d}", "plain"), request(f"gold-{i:07d}", "gold")]
        order = await held_while_draining(p, requests, [])
        first = [rid.split("-")[0] for rid in order[:12]]
        # The first round takes each team's head; from then on gold's tokens count a third as much.
        assert first.count("gold") == 8, first
        assert first.count("plain") == 4, first


async def test_preempted_batch_requests_finish_whole_and_are_charged_what_they_used(bus: Bus) -> None:
    """KV blocks for about three long answers at a time: six long batch requests, and interactive ones
    beside them, which the engine serves first. Batch requests are preempted and computed again; every
    answer is still the whole deterministic answer, its usage is its prompt and that answer, and the
    team's day counter holds the sum."""
    engine = SimulatedEngineConfig(
        ttft_ms=5, token_ms=4, max_running=8, kv_blocks=40, min_words=40, max_words=40
    )
    async with pipeline(bus, engine=engine, batch_headroom_fraction=0.0) as p:
        names = p.settings.names
        reply = names.results_topic("acme")
        await create_topics(p.settings, reply, partitions=1)
        signer = await register_signer(p.redis, names, "acme")
        texts = [f"batch item {i}: summarise the queue" for i in range(6)]
        subs = [submission(f"long-{i}", chat(texts[i], max_tokens=MAX_TOKENS)) for i in range(6)]
        await produce(p.settings, [(names.batch_topic("sim"), json.dumps(s).encode()) for s in subs], signer)
        # Batch requests run (about three fit the KV blocks) before the interactive ones arrive.
        await eventually(lambda: replay_logs(p, 3), 30, "three batch requests started")
        interactive = [make_request("sim", f"urgent-{i:07d}", max_tokens=120) for i in range(4)]
        ready = asyncio.Event()
        urgent = asyncio.create_task(start_order(p, {r.request_id for r in interactive}, ready, 60))
        await ready.wait()
        for r in interactive:
            await p.producer.send_and_wait(names.requests_topic("sim"), encode(r), key=r.request_id.encode())
        answers = await read_answers(p.settings.kafka_bootstrap, reply, 6, 60)
        await urgent  # each interactive request finished too
        assert sorted(a["custom_id"] for a in answers) == [f"long-{i}" for i in range(6)]
        used = 0
        for a in answers:
            assert a["response"]["status_code"] == 200, a
            body = a["response"]["body"]
            prompt = ByteTokenizer().encode_chat(
                [ChatMessage(role="user", content=texts[int(a["custom_id"][5:])])]
            )
            whole, _ = apply_stops(answer_to(prompt, 40, 40), MAX_TOKENS, ())
            assert body["choices"][0]["message"]["content"] == whole
            assert body["usage"]["prompt_tokens"] == len(prompt)
            assert body["usage"]["completion_tokens"] == len(whole)
            used += body["usage"]["total_tokens"]
        beat = decode(Heartbeat, await p.redis.get(names.heartbeat("sim", p.worker_id)) or b"")
        assert beat.preemptions > 0, "the engine preempted nothing: the test no longer tests preemption"
        day = await p.redis.keys(names.quota_day("acme", "*"))
        assert int(await p.redis.get(day[0]) or 0) == used
