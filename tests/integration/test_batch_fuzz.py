"""Random batch records, signed or not, with random reply topics and bodies, against a live dispatcher and
worker on the real broker and Redis, beside interactive traffic: no service dies, interactive requests
keep finishing, and no answer reaches a topic its (proven) team does not own."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_schemas.messages import FinalChunk
from queue_schemas.signing import sign_record
from queue_schemas.teams import TeamLimits, TeamRecord
from tests.conftest import Bus
from tests.integration.helpers import (
    chat,
    create_topics,
    lag_reader,
    make_request,
    pipeline,
    read_answers,
    register_signer,
)
from tests.integration.test_dispatch_path import send_and_collect
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(600)

VICTIM = "victim.answers"  # owned by no team: nothing may ever be answered there
BODIES = [
    chat("hello", max_tokens=4),
    chat("x", n=2),
    {**chat("x"), "model": "nope"},
    chat("x", stream=True),
    chat("x", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}}),
    chat("x", max_tokens=10**9),
    {"model": "sluice-sim"},
    "not an object",
]

record_plan = st.fixed_dictionaries(
    {
        "team": st.sampled_from(["acme", "ghost", "mallory", "", "NOT A TEAM"]),
        "signer": st.sampled_from(["acme", "mallory", "ghost", "none", "tampered"]),
        "reply": st.sampled_from([None, "results", "owned", "victim", "invalid", "requests", 7]),
        "body": st.sampled_from(range(len(BODIES))),
        "request_id": st.sampled_from(["r-1", "r-2", "", "x" * 200, "a b"]),
        "version": st.sampled_from([1, 1, 1, 2, None]),
        "garbage": st.booleans(),
    }
)


def record_value(plan: dict[str, Any], prefix: str, index: int) -> bytes:
    if plan["garbage"]:
        return b"\xff{not json"
    replies = {
        None: None, "results": f"{prefix}.results.{plan['team']}", "owned": f"answers.{prefix}.x",
        "victim": VICTIM, "invalid": "no spaces", "requests": f"{prefix}.requests.sim", 7: 7,
    }  # fmt: skip
    sub = {
        "v": plan["version"], "request_id": plan["request_id"], "custom_id": custom_id(index),
        "team": plan["team"], "reply_topic": replies[plan["reply"]], "body": BODIES[plan["body"]],
    }  # fmt: skip
    return json.dumps({k: v for k, v in sub.items() if v is not None}).encode()


def custom_id(index: int) -> str:
    """Each record's own, so that an answer names the record it answers."""
    return f"c{index}"


def may_answer_on(plan: dict[str, Any], topic: str, prefix: str) -> bool:
    """Whether the team the record's signature proves owns `topic`: its results topic, or (acme alone)
    a topic under its reply prefix. What the record says of its own team proves nothing."""
    signer = plan["signer"]
    if signer not in ("acme", "mallory", "ghost"):
        return False  # unsigned, or signed over other bytes
    return topic == f"{prefix}.results.{signer}" or (
        signer == "acme" and topic.startswith(f"answers.{prefix}.")
    )


def headers_for(plan: dict[str, Any], value: bytes, signers: dict[str, Ed25519PrivateKey]) -> Any:
    if plan["signer"] == "none":
        return None
    if plan["signer"] == "tampered":
        return sign_record(signers["acme"], value + b" ")
    return sign_record(signers[plan["signer"]], value)


@contextlib.asynccontextmanager
async def client_producer(bus: Bus) -> AsyncIterator[AIOKafkaProducer]:
    producer = AIOKafkaProducer(bootstrap_servers=bus.kafka_bootstrap)
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def everything_on(bootstrap: str, topics: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every answer on the topics, read once their producers are done (a read that brings nothing ends
    it)."""
    consumer = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    found: list[tuple[str, dict[str, Any]]] = []
    try:
        while batch := await consumer.getmany(timeout_ms=1000):
            found += [(tp.topic, json.loads(r.value)) for tp, records in batch.items() for r in records]
    finally:
        await consumer.stop()
    return found


async def scenario(bus: Bus, plans: list[dict[str, Any]]) -> None:
    # The services answer with a short request timeout, so an undeliverable answer fails fast; the
    # submitter and the interactive client are separate clients with the usual one.
    async with pipeline(bus, kafka_request_timeout_ms=1500) as p, client_producer(bus) as client:
        names = p.settings.names
        limits = TeamLimits(daily_tokens=300)  # some requests fit, later ones are refused
        record = TeamRecord(team="acme", limits=limits, reply_prefixes=(f"answers.{names.prefix}.",))
        await p.redis.set(names.team("acme"), record.model_dump_json())
        signers = {team: await register_signer(p.redis, names, team) for team in ("acme", "mallory", "ghost")}
        await p.redis.delete(names.team("ghost"))
        # Every topic an answer may go to exists first, as on a cluster with topic auto-creation off.
        answered = [names.results_topic(t) for t in ("acme", "mallory", "ghost")]
        answered.append(f"answers.{names.prefix}.x")
        await create_topics(p.settings, VICTIM, *answered, partitions=1)
        topic = names.batch_topic("sim")
        for i, plan in enumerate(plans):
            value = record_value(plan, names.prefix, i)
            await client.send_and_wait(topic, value, headers=headers_for(plan, value, signers))
            if i % 5 == 0:  # interactive traffic keeps flowing meanwhile
                request = make_request("sim", f"interactive-{i:04d}", max_tokens=3)
                events = await send_and_collect(p, request, client)
                assert isinstance(events[-1], FinalChunk), events
                assert not p.crashed()
        events = await send_and_collect(p, make_request("sim", "interactive-last", max_tokens=3), client)
        assert isinstance(events[-1], FinalChunk), events
        # Every batch record finished (answered, refused or dead-lettered) before the victim is read.
        async with lag_reader(p.settings) as reader:

            async def finished() -> bool:
                return (await reader.read("sim", batch=True)).total == 0

            await eventually(finished, 30, "every batch record's offset committed")
        assert await read_answers(p.settings.kafka_bootstrap, VICTIM, 1, 2) == []
        # Every answer, on every topic one may reach, went where its proven team may receive it.
        by_id = {custom_id(i): plan for i, plan in enumerate(plans)}
        for topic, answer in await everything_on(p.settings.kafka_bootstrap, answered):
            plan = by_id[answer["custom_id"]]
            assert may_answer_on(plan, topic, names.prefix), (topic, plan)
        assert not p.crashed()


EXAMPLES = 4  # the same 4 every run (tests/conftest.py); each runs a pipeline through 15-30 records


@settings(
    max_examples=EXAMPLES, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(plans=st.lists(record_plan, min_size=15, max_size=30))
def test_random_batch_records_never_stop_the_pool(bus: Bus, plans: list[dict[str, Any]]) -> None:
    asyncio.run(scenario(bus, plans))


def test_every_signer_and_reply_topic_pair_is_answered_only_where_the_signer_may_receive(bus: Bus) -> None:
    """The pairs the random plans reach only by chance, each once: a valid record whose claimed team is
    its signer's, for every signer and reply topic."""
    plans = [
        {"team": signer, "signer": signer, "reply": reply, "body": 0, "request_id": f"r-{n}", "version": 1,
         "garbage": False}
        for n, (signer, reply) in enumerate(
            (s, r) for s in ("acme", "mallory", "ghost") for r in (None, "results", "owned", "victim")
        )
    ]  # fmt: skip
    asyncio.run(scenario(bus, plans))
