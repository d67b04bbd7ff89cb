"""Batch records from producers that are not who they claim, answers that cannot be delivered, and a
request that meets a bug in the worker."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gpu_workers.simulated import reply_text
from openai_api.quota_gate import QuotaGate
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, FinalChunk, TokenChunk
from queue_schemas.signing import sign_record
from queue_schemas.teams import TeamLimits, TeamRecord
from tests.conftest import Bus, read_dead_letters
from tests.integration.helpers import (
    Pipeline,
    chat,
    create_topics,
    make_request,
    pipeline,
    produce,
    read_answers,
    register_signer,
    submission,
)
from tests.integration.test_dispatch_path import send_and_collect

pytestmark = pytest.mark.timeout(120)


async def wait_acknowledged(p: Pipeline, within_s: float = 5.0) -> None:
    """Until the worker's inbox has no entry pending (each is acknowledged after its answer goes out)."""
    deadline = time.monotonic() + within_s
    while (await p.redis.xpending(p.settings.names.inbox(p.worker_id), "worker"))["pending"]:
        assert time.monotonic() < deadline, "an inbox entry stayed unacknowledged"
        await asyncio.sleep(0.05)


async def test_a_record_naming_another_team_is_never_served_answered_or_charged(bus: Bus) -> None:
    async with pipeline(bus) as p:
        names = p.settings.names
        limits = TeamLimits(daily_tokens=100_000)
        await p.redis.set(names.team("acme"), TeamRecord(team="acme", limits=limits).model_dump_json())
        acme = await register_signer(p.redis, names, "acme")
        mallory = await register_signer(p.redis, names, "mallory")
        acme_results, mallory_results = names.results_topic("acme"), names.results_topic("mallory")
        await create_topics(p.settings, acme_results, mallory_results, partitions=1)
        topic = names.batch_topic("sim")

        def record(sub: dict[str, object]) -> tuple[str, bytes]:
            return topic, json.dumps(sub).encode()

        forged = submission("r-1", chat("bill acme for this"))  # names acme, signed by mallory
        await produce(p.settings, [record(forged)], mallory)
        await produce(p.settings, [record(submission("r-2", chat("unsigned")))])  # no signature at all
        genuine = submission("r-3", chat("acme's own words"))
        _, raw = record(genuine)
        tampered = raw.replace(b"acme's own words", b"mallory's words!")
        await p.producer.send_and_wait(
            topic, tampered, headers=sign_record(acme, raw)
        )  # acme's signature on other bytes
        # The ids mallory tried to take are still acme's, and mallory's own r-1 is its own request.
        await produce(p.settings, [record(submission("r-1", chat("acme's real r-1")))], acme)
        await produce(p.settings, [record(submission("r-1", chat("mine"), team="mallory"))], mallory)

        acme_answers = await read_answers(p.settings.kafka_bootstrap, acme_results, 1, 20)
        mallory_answers = await read_answers(p.settings.kafka_bootstrap, mallory_results, 1, 10)
        assert [(a["custom_id"], a["response"]["status_code"]) for a in acme_answers] == [("r-1", 200)]
        assert [(a["custom_id"], a["response"]["status_code"]) for a in mallory_answers] == [("r-1", 200)]
        usage = acme_answers[0]["response"]["body"]["usage"]["total_tokens"]
        day = await p.redis.keys(names.quota_day("acme", "*"))
        assert int(await p.redis.get(day[0]) or 0) == usage  # acme paid for its own request only

        reasons = sorted(
            letter.reason for letter in await read_dead_letters(p.settings.kafka_bootstrap, names, at_least=3)
        )
        assert len(reasons) == 3, reasons
        assert any("is not registered for team 'acme'" in r for r in reasons)  # mallory's key
        assert any("unsigned record" in r for r in reasons)
        assert any("signature does not match" in r for r in reasons)


async def test_answers_that_cannot_be_delivered_are_dead_lettered_and_the_pool_keeps_serving(
    bus: Bus,
) -> None:
    """A reply topic the broker refuses (here '..', which no Kafka broker accepts; on a cluster, a topic
    the ACLs deny or one missing with auto-creation off): the dispatcher's refusal and the worker's
    completed answer both go to the dead-letter topic, the request is charged and acknowledged, and
    interactive requests keep flowing meanwhile."""
    async with pipeline(bus, kafka_request_timeout_ms=2000) as p:
        names = p.settings.names
        # An operator registered a prefix that covers a topic the broker will not take.
        record = TeamRecord(team="acme", limits=TeamLimits(daily_tokens=100_000), reply_prefixes=(".",))
        await p.redis.set(names.team("acme"), record.model_dump_json())
        acme = await register_signer(p.redis, names, "acme")
        topic = names.batch_topic("sim")
        served = submission("served", chat("an answer nobody can receive", max_tokens=5), reply_topic="..")
        refused = submission("refused", chat("x", n=2), reply_topic="..")
        await produce(p.settings, [(topic, json.dumps(s).encode()) for s in (served, refused)], acme)
        alongside = [make_request("sim", f"alongside-request-{i}", max_tokens=4) for i in range(5)]
        # Interactive traffic, all at once, while the two answers fail (each waits out produce timeouts).
        for events in await asyncio.gather(*(send_and_collect(p, r) for r in alongside)):
            assert isinstance(events[-1], FinalChunk), events
        interactive_done = time.time()

        letters = await read_dead_letters(
            p.settings.kafka_bootstrap, names, at_least=2, wanted=lambda letter: letter.source == ".."
        )
        by_id = {json.loads(letter.payload)["custom_id"]: letter for letter in letters}
        assert set(by_id) == {"served", "refused"}, letters
        assert json.loads(by_id["served"].payload)["response"]["status_code"] == 200
        assert json.loads(by_id["refused"].payload)["response"]["status_code"] == 400
        assert by_id["served"].consumer == p.worker_id
        assert "could not be delivered" in by_id["served"].reason
        assert not p.crashed()
        # The worker acknowledges the entry right after (nothing left pending to run again) and charged
        # what was used.
        await wait_acknowledged(p)
        day = await p.redis.keys(names.quota_day("acme", "*"))
        used = json.loads(by_id["served"].payload)["response"]["body"]["usage"]["total_tokens"]
        assert int(await p.redis.get(day[0]) or 0) == used
        # The interactive requests did not wait for the refusal: they were done before it was dead-lettered.
        assert interactive_done < by_id["refused"].failed_at


async def test_an_unexpected_fault_in_one_request_ends_it_and_the_worker_goes_on(bus: Bus) -> None:
    """Not an engine error, not a bus error: a bug met while serving. The request ends with engine_error,
    its reservation is settled to what it used, its entry is acknowledged, and the next request is served."""
    engine = SimulatedEngineConfig(ttft_ms=5, token_ms=1, fail_after_tokens=3, fault_kind="bug")
    async with pipeline(bus, engine=engine) as p:
        names = p.settings.names
        for i in range(2):
            request = make_request("sim", f"bug-request-{i}", max_tokens=8)
            limits = TeamLimits(daily_tokens=100_000)
            await QuotaGate(p.redis, names).reserve("dev", limits, request.request_id, 58, 60)
            events = await send_and_collect(p, request)
            assert isinstance(events[-1], ErrorChunk), events
            assert events[-1].code == ErrorCode.ENGINE_ERROR
            assert "".join(e.text for e in events if isinstance(e, TokenChunk)) == reply_text(request)[:3]
            assert not await p.redis.exists(names.reservation(request.team, request.request_id))  # settled
        day = await p.redis.keys(names.quota_day("dev", "*"))
        assert int(await p.redis.get(day[0]) or 0) == 2 * (50 + 3)  # prompt + the 3 tokens each produced
        await wait_acknowledged(p)
        assert not p.crashed()
