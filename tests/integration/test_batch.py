"""Batch through Kafka, as a submitter following docs/batch.md with a plain aiokafka client sees it."""

from __future__ import annotations

import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpu_workers.simulated import answer_to
from openai_api.openai_types import ChatMessage
from openai_api.quota_gate import QuotaGate
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.batch import internal_request_id
from queue_schemas.teams import TeamLimits, TeamRecord
from tests.conftest import Bus, read_dead_letters
from tests.integration.helpers import (
    Pipeline,
    chat,
    create_topics,
    pipeline,
    produce,
    read_answers,
    register_signer,
    submission,
)


async def budgeted_team(p: Pipeline, limits: TeamLimits) -> tuple[Ed25519PrivateKey, str]:
    """Team acme with `limits`, a registered signing key, and its results topic made."""
    names = p.settings.names
    await p.redis.set(names.team("acme"), TeamRecord(team="acme", limits=limits).model_dump_json())
    signer = await register_signer(p.redis, names, "acme")
    reply = names.results_topic("acme")
    await create_topics(p.settings, reply, partitions=1)
    return signer, reply


async def charged_today(p: Pipeline) -> int:
    """What acme's day counter holds."""
    day = await p.redis.keys(p.settings.names.quota_day("acme", "*"))
    return int(await p.redis.get(day[0]) or 0)


async def test_a_plain_kafka_submitter_gets_one_answer_per_submission(bus: Bus) -> None:
    async with pipeline(bus, workers=2) as p:
        names = p.settings.names
        reply_prefix = f"answers.{names.prefix}."
        record = TeamRecord(team="acme", reply_prefixes=(reply_prefix,))
        await p.redis.set(names.team("acme"), record.model_dump_json())
        acme = await register_signer(p.redis, names, "acme")
        ghost = await register_signer(p.redis, names, "ghost")
        await p.redis.delete(names.team("ghost"))  # a signer whose team record is gone: refused
        reply = reply_prefix + "acme"
        # Every topic an answer goes to exists first, as on a cluster with topic auto-creation off (the
        # dev broker would create one on its first produce).
        results = [names.results_topic(team) for team in ("ghost", "acme")]
        await create_topics(p.settings, reply, *results, partitions=1)
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
            "bad-version": (submission("bad-version", chat("x"), v=2), 400, None),
            "bad-token": (
                submission("bad-token", chat("x"), prompt_token_ids=[1, 999]),
                400,
                "prompt_token_ids",
            ),
            "bad-stream": (submission("bad-stream", chat("x", stream=True)), 400, "stream"),
        }
        topic = names.batch_topic("sim")
        for sub in [*good.values(), *(s for s, _, _ in refused.values())]:
            sub.setdefault("reply_topic", reply)
        records = [
            (topic, json.dumps(sub).encode())
            for sub in [*good.values(), *(s for s, _, _ in refused.values())]
        ]
        records += [
            (topic, b"{not json"),
            (topic, json.dumps(submission("x", chat("x"), reply_topic="no spaces")).encode()),
            (topic, json.dumps(good["chat-1"]).encode()),  # a resubmission
        ]
        await produce(p.settings, records, acme)
        not_owned = submission("bad-topic", chat("x"), reply_topic=names.results_topic("ghost"))
        ghostly = submission("ghost-1", chat("x"), team="ghost")
        await produce(p.settings, [(topic, json.dumps(not_owned).encode())], acme)
        await produce(p.settings, [(topic, json.dumps(ghostly).encode())], ghost)
        answers = await read_answers(p.settings.kafka_bootstrap, reply, len(good) + len(refused), 30)
        ghost_answers = await read_answers(p.settings.kafka_bootstrap, names.results_topic("ghost"), 1, 10)
        own_answers = await read_answers(p.settings.kafka_bootstrap, names.results_topic("acme"), 1, 10)

        by_id = {a["custom_id"]: a for a in answers}
        assert sorted(a["custom_id"] for a in answers) == sorted([*good, *refused])  # each exactly once
        for cid in good:
            answer = by_id[cid]
            assert (answer["v"], answer["request_id"], answer["error"]) == (1, cid, None)
            assert answer["response"]["status_code"] == 200, answer
            body = answer["response"]["body"]
            assert body["usage"]["completion_tokens"] > 0
        # The simulated engine's exact answers (one byte per token) to each prompt as the service built it.
        tokenizer = ByteTokenizer()
        exact = {
            "chat-1": answer_to(tokenizer.encode_chat([ChatMessage(role="user", content="hello there")])),
            "text-1": answer_to(tokenizer.encode_text("once upon"))[:5],
            "tok-1": answer_to(list(b"pre-tokenized prompt")),
        }
        for cid, text in exact.items():
            choice = by_id[cid]["response"]["body"]["choices"][0]
            assert (choice["message"]["content"] if "message" in choice else choice["text"]) == text, cid
        assert by_id["text-1"]["response"]["body"]["object"] == "text_completion"
        assert by_id["tok-1"]["response"]["body"]["usage"]["prompt_tokens"] == len(b"pre-tokenized prompt")
        content = by_id["json-1"]["response"]["body"]["choices"][0]["message"]["content"]
        assert isinstance(json.loads(content)["n"], int)
        for cid, (_, status, param) in refused.items():
            response = by_id[cid]["response"]
            assert response["status_code"] == status, by_id[cid]
            assert response["body"]["error"]["param"] == param, response
        assert "version" in by_id["bad-version"]["response"]["body"]["error"]["message"]

        # A reply topic the team does not own: refused on the team's own results topic, never sent there.
        assert [a["custom_id"] for a in own_answers] == ["bad-topic"]
        error = own_answers[0]["response"]["body"]["error"]
        assert (error["code"], error["param"]) == ("reply_topic_not_owned", "reply_topic")
        # The refusal for a team without a record goes to that team's own results topic.
        assert [a["custom_id"] for a in ghost_answers] == ["ghost-1"]
        error = ghost_answers[0]["response"]["body"]["error"]
        assert (error["code"], error["param"]) == ("unknown_team", "team")
        letters = await read_dead_letters(p.settings.kafka_bootstrap, names, at_least=2)
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
        acme, reply = await budgeted_team(p, limits)
        # each reserves its prompt (about 50 tokens) + 100 allowed output tokens
        subs = [submission(f"q-{i}", chat(f"question number {i}", max_tokens=100)) for i in range(6)]
        await produce(
            p.settings, [(names.batch_topic("sim"), json.dumps(sub).encode()) for sub in subs], acme
        )
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
        assert await charged_today(p) == used  # settled to the real usage


async def test_a_record_claimed_by_a_dispatcher_that_died_is_answered_and_charged_once(bus: Bus) -> None:
    """A dispatcher reserved the team's quota for a batch request, claimed it for a worker and died before
    appending it to the worker's inbox. The record read again is appended to that worker, answered once,
    and the team is charged its real usage once (the first reservation is not taken again)."""
    async with pipeline(bus, workers=1) as p:
        names = p.settings.names
        limits = TeamLimits(daily_tokens=10_000)
        acme, reply = await budgeted_team(p, limits)
        rid = internal_request_id("acme", "q-claimed")
        await QuotaGate(p.redis, names).reserve("acme", limits, rid, 300, hold_s=60)
        await p.redis.set(names.placement(rid), p.worker_id)
        sub = submission("q-claimed", chat("claimed and never appended", max_tokens=5))
        await produce(p.settings, [(names.batch_topic("sim"), json.dumps(sub).encode())], acme)
        answers = await read_answers(p.settings.kafka_bootstrap, reply, 1, 30)
        assert len(answers) == 1, answers
        assert answers[0]["response"]["status_code"] == 200
        used = answers[0]["response"]["body"]["usage"]["total_tokens"]
        assert await p.redis.get(names.started(rid)) == p.worker_id.encode()
        assert await charged_today(p) == used, "charged once, its real usage"
