"""Batch through Kafka, as a submitter following docs/batch.md with a plain aiokafka client sees it."""

from __future__ import annotations

import json

import pytest
from aiokafka import AIOKafkaProducer

from queue_schemas.quota import TeamLimits, TeamRecord
from tests.conftest import Bus, read_dead_letters
from tests.integration.helpers import chat, create_topics, pipeline, read_answers, submission

pytestmark = pytest.mark.integration


async def test_a_plain_kafka_submitter_gets_one_answer_per_submission(bus: Bus) -> None:
    async with pipeline(bus, workers=2) as p:
        names = p.settings.names
        await p.redis.set(names.team("acme"), TeamRecord(team="acme").model_dump_json())
        reply = f"{names.prefix}.answers.acme"
        await create_topics(p.settings, reply, partitions=1)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        good = {
            "chat-1": submission("chat-1", chat("hello there")),
            "text-1": submission(
                "text-1",
                {"model": "sluice-sim", "prompt": "once upon", "max_tokens": 5},
                url="/v1/completions",
            ),
            "tok-1": submission("tok-1", chat("ignored"), prompt_token_ids=list(b"pre-tokenized prompt")),
            "json-1": submission("json-1", chat("a number", response_format=fmt)),
        }
        refused = {
            "bad-n": (submission("bad-n", chat("x", n=2)), 400, "n"),
            "bad-model": (submission("bad-model", {**chat("x"), "model": "nope"}), 404, "model"),
            "bad-team": (submission("bad-team", chat("x"), team="ghost", reply_topic=reply), 400, "team"),
            "bad-version": (submission("bad-version", chat("x"), v=2), 400, None),
            "bad-token": (
                submission("bad-token", chat("x"), prompt_token_ids=[1, 999]),
                400,
                "prompt_token_ids",
            ),
            "bad-stream": (submission("bad-stream", chat("x", stream=True)), 400, "stream"),
        }
        producer = AIOKafkaProducer(bootstrap_servers=p.settings.kafka_bootstrap)
        await producer.start()
        try:
            topic = names.batch_topic("sim")
            for sub in [*good.values(), *(s for s, _, _ in refused.values())]:
                sub.setdefault("reply_topic", reply)
                await producer.send_and_wait(topic, json.dumps(sub).encode())
            await producer.send_and_wait(topic, b"{not json")
            await producer.send_and_wait(
                topic, json.dumps(submission("x", chat("x"), reply_topic="no spaces")).encode()
            )
            await producer.send_and_wait(topic, json.dumps(good["chat-1"]).encode())  # a resubmission
        finally:
            await producer.stop()
        answers = await read_answers(p.settings.kafka_bootstrap, reply, len(good) + len(refused), 30)

        by_id = {a["custom_id"]: a for a in answers}
        assert sorted(a["custom_id"] for a in answers) == sorted([*good, *refused])  # each exactly once
        for cid in good:
            answer = by_id[cid]
            assert (answer["v"], answer["request_id"], answer["error"]) == (1, cid, None)
            assert answer["response"]["status_code"] == 200, answer
            body = answer["response"]["body"]
            assert body["usage"]["completion_tokens"] > 0
        assert by_id["text-1"]["response"]["body"]["object"] == "text_completion"
        assert by_id["tok-1"]["response"]["body"]["usage"]["prompt_tokens"] == len(b"pre-tokenized prompt")
        content = by_id["json-1"]["response"]["body"]["choices"][0]["message"]["content"]
        assert isinstance(json.loads(content)["n"], int)
        for cid, (_, status, param) in refused.items():
            response = by_id[cid]["response"]
            assert response["status_code"] == status, by_id[cid]
            assert response["body"]["error"]["param"] == param, response
        assert "version" in by_id["bad-version"]["response"]["body"]["error"]["message"]

        letters = await read_dead_letters(p.settings.kafka_bootstrap, names)
        reasons = sorted(letter.reason for letter in letters)
        assert len(reasons) == 2, reasons
        assert any("not valid JSON" in r for r in reasons)
        assert any("not a valid Kafka topic name" in r for r in reasons)


async def test_batch_quota_is_reserved_and_settled(bus: Bus) -> None:
    """A team with a daily budget: the batch is charged its real usage, and what the budget cannot cover
    is answered with insufficient_quota."""
    async with pipeline(bus, workers=1) as p:
        names = p.settings.names
        limits = TeamLimits(daily_tokens=400)
        await p.redis.set(names.team("acme"), TeamRecord(team="acme", limits=limits).model_dump_json())
        reply = names.results_topic("acme")
        await create_topics(p.settings, reply, partitions=1)
        producer = AIOKafkaProducer(bootstrap_servers=p.settings.kafka_bootstrap)
        await producer.start()
        try:
            for i in range(6):  # each reserves its prompt (about 50 tokens) + 100 allowed output tokens
                sub = submission(f"q-{i}", chat(f"question number {i}", max_tokens=100))
                await producer.send_and_wait(names.batch_topic("sim"), json.dumps(sub).encode())
        finally:
            await producer.stop()
        answers = await read_answers(p.settings.kafka_bootstrap, reply, 6, 30)
        statuses = sorted(a["response"]["status_code"] for a in answers)
        assert len(answers) == 6
        assert {200, 429} <= set(statuses), statuses
        used = sum(
            a["response"]["body"]["usage"]["total_tokens"]
            for a in answers
            if a["response"]["status_code"] == 200
        )
        refused = [a for a in answers if a["response"]["status_code"] == 429]
        assert all(a["response"]["body"]["error"]["code"] == "insufficient_quota" for a in refused)
        day = await p.redis.keys(names.quota_day("acme", "*"))
        assert int(await p.redis.get(day[0]) or 0) == used  # settled to the real usage
