"""The batch keeper against a real broker and Redis, driven round by round: a line the broker refuses is
answered and its batch goes on; a batch whose step keeps raising fails alone with the reason while
another team's batch moves on; a poisoned answer on the answers topic is passed over; a revoked key
cancels its batch."""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from ingress.batches import collector as collector_module
from ingress.batches.api import (
    BatchCreate,
    FileRecord,
    as_text,
    new_batch_fields,
    new_batch_id,
    new_file_id,
    object_key,
    parse_line_request_id,
    scan_file,
)
from ingress.batches.keeper import STEP_FAULTS, BatchKeeper, save_file_record
from ingress.batches.object_store import LocalStore
from ingress.team_caps import BATCH_LINES, BATCHES, BYTES, FILES, TeamCaps
from plumbing.health import ITEMS_FAILED
from queue_schemas.config import load_config
from queue_schemas.keys import TeamKey
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings
from tests.conftest import Bus
from tests.integration.helpers import create_topics, keys_to_end

pytestmark = pytest.mark.timeout(120)

CAPS = TeamCaps(files=10, file_bytes=10**8, active_batches=5, batch_lines=10_000, stored_responses=5)
DEFAULT_POOLS = Path(__file__).parents[2] / "queue_schemas" / "default_pools.toml"


def line(custom_id: str, content: str = "hi") -> bytes:
    body = {"model": "sluice-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    row = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(row).encode() + b"\n"


class Harness:
    def __init__(self, settings: BusSettings, redis: aioredis.Redis, keeper: BatchKeeper) -> None:
        self.settings = settings
        self.names: Names = settings.names
        self.redis = redis
        self.keeper = keeper

    async def batch(self, team: str, data: bytes, key_hash: str = "") -> str:
        """A file and a batch over it, as the routes make them."""
        file_id = new_file_id()
        summary = scan_file(io.BytesIO(data))
        assert not isinstance(summary, str), summary
        record = FileRecord(
            id=file_id, team=team, purpose="batch", filename="in.jsonl", bytes=len(data),
            created_at=int(time.time()), key=object_key(team, file_id), lines=summary.requests,
            endpoints=summary.endpoints,
        )  # fmt: skip
        await self.keeper.store.put_file(record.key, io.BytesIO(data))
        await save_file_record(self.redis, self.names, record)
        batch_id = new_batch_id()
        key = TeamKey(team=team, key_id="sk-sluice-test", created_at=time.time())
        body = BatchCreate(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        fields = new_batch_fields(batch_id, key, body, summary.requests, time.time(), key_hash)
        fields["capped"] = "1"
        await self.keeper.storage.take(team, {BATCHES: 1, BATCH_LINES: summary.requests})
        await self.redis.hset(self.names.batch_record(team, batch_id), mapping=fields)  # type: ignore[arg-type]
        await self.redis.sadd(self.names.active_batches(), f"{team}/{batch_id}")
        return batch_id

    async def fields(self, team: str, batch_id: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.names.batch_record(team, batch_id))
        return {as_text(k): as_text(v) for k, v in raw.items()}

    async def answers(self, team: str, batch_id: str) -> dict[int, dict[str, object]]:
        raw = await self.redis.hgetall(self.names.batch_lines(team, batch_id))
        return {int(k): json.loads(v) for k, v in raw.items()}

    async def rounds(self, n: int) -> None:
        for _ in range(n):
            await self.keeper._keep_round()


@asynccontextmanager
async def harness(bus: Bus, tmp_path: Path, max_request_size: int = 1024 * 1024) -> AsyncIterator[Harness]:
    settings = bus.settings()
    names = settings.names
    await create_topics(settings, names.batch_topic("sim"), names.batch_api_answers_topic(), partitions=1)
    redis = aioredis.Redis.from_url(settings.redis_url)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, max_request_size=max_request_size)
    await producer.start()
    options = {"bootstrap_servers": settings.kafka_bootstrap, "group_id": names.batch_api_collector_group()}
    keeper = BatchKeeper(
        names, load_config(DEFAULT_POOLS), redis, producer, LocalStore(tmp_path / "files"), options, 0.05,
        caps=CAPS,
    )  # fmt: skip
    try:
        yield Harness(settings, redis, keeper)
    finally:
        await keeper.close()
        await producer.stop()
        await redis.aclose()


async def sent_keys(settings: BusSettings) -> Counter[bytes]:
    return await keys_to_end(settings.kafka_bootstrap, settings.names.batch_topic("sim"))


async def test_a_line_the_broker_refuses_is_answered_and_the_batch_goes_on(bus: Bus, tmp_path: Path) -> None:
    # The producer takes records of up to 3,000 bytes: line 2 fits a file line but not the record.
    async with harness(bus, tmp_path, max_request_size=3000) as h:
        data = line("a") + line("b") + line("big", "x" * 4000) + line("c") + line("d")
        batch_id = await h.batch("acme", data)
        await h.rounds(4)
        fields = await h.fields("acme", batch_id)
        assert fields["status"] == "in_progress"
        assert fields["cursor"] == "5"
        assert int(fields["offset"]) == len(data)
        answers = await h.answers("acme", batch_id)
        assert list(answers) == [2]
        error = answers[2]["error"]
        assert answers[2]["custom_id"] == "big"
        assert isinstance(error, dict)
        assert error["code"] == "enqueue_failed"
        keys = await sent_keys(h.settings)
        assert sorted(keys) == [f"acme:{batch_id}:{n}".encode() for n in (0, 1, 3, 4)]
        assert set(keys.values()) == {1}, "a line was sent more than once"


async def test_a_batch_whose_step_raises_fails_alone(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        poisoned = await h.batch("mallory", line("p0") + line("p1"))
        healthy = await h.batch("acme", line("a0") + line("a1") + line("a2"))
        # The stored object no longer holds what its upload held (a corrupt or swapped object).
        file_id = (await h.fields("mallory", poisoned))["input_file_id"]
        raw = await h.redis.get(h.names.file_record("mallory", file_id))
        record = FileRecord.model_validate_json(raw or b"")
        await h.keeper.store.put(record.key, b'{"custom_id": 1}\n' * 3)
        failed_before = ITEMS_FAILED.labels("ingress.batch_keeper")._value.get()
        await h.rounds(STEP_FAULTS + 2)
        bad = await h.fields("mallory", poisoned)
        assert bad["status"] == "failed"
        assert "could not be processed (ValueError)" in bad["errors"]
        assert ITEMS_FAILED.labels("ingress.batch_keeper")._value.get() == failed_before + 1
        good = await h.fields("acme", healthy)
        assert good["status"] == "in_progress"
        assert good["cursor"] == "3"
        assert f"mallory/{poisoned}".encode() not in await h.redis.smembers(h.names.active_batches())
        assert await h.redis.ttl(h.names.batch_record("mallory", poisoned)) > 0, (
            "a failed batch is kept forever"
        )


async def test_a_batch_that_fails_validation_is_kept_only_for_its_retention(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        mixed = line("a0") + line("a1").replace(b"/v1/chat/completions", b"/v1/completions")
        batch_id = await h.batch("acme", mixed)
        await h.rounds(2)
        fields = await h.fields("acme", batch_id)
        assert fields["status"] == "failed"
        assert json.loads(fields["errors"])["data"][0]["line"] == 2
        assert await h.redis.ttl(h.names.batch_record("acme", batch_id)) > 0


async def test_a_poisoned_answer_is_passed_over(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(bus, tmp_path) as h:
        batch_id = await h.batch("acme", line("a0"))
        await h.rounds(2)
        answer = {
            "v": 1, "id": "ans-1", "request_id": f"acme:{batch_id}:0", "custom_id": "a0",
            "response": {"status_code": 200, "request_id": "r", "body": {"ok": True}}, "error": None,
        }  # fmt: skip
        # Depth a JSON parser takes but the models' own checks do not: decoding it must not end the loop.
        await h.keeper.collector.collect_alone(b"[" * 5000 + b"]" * 5000)
        # An answer whose handling raises past every check: it alone is passed over, and counted.
        real = parse_line_request_id

        def faulty(request_id: str) -> tuple[str, str, int] | None:
            if request_id == "boom":
                raise KeyError(request_id)
            return real(request_id)

        monkeypatch.setattr(collector_module, "parse_line_request_id", faulty)
        failed_before = ITEMS_FAILED.labels("ingress.batch_collector")._value.get()
        await h.keeper.collector.collect_alone(json.dumps({**answer, "request_id": "boom"}).encode())
        assert ITEMS_FAILED.labels("ingress.batch_collector")._value.get() == failed_before + 1
        await h.keeper.collector.collect_alone(json.dumps(answer).encode())
        answers = await h.answers("acme", batch_id)
        assert answers[0]["custom_id"] == "a0"


async def test_a_revoked_key_cancels_its_batch(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        await h.redis.set(h.names.api_key("f" * 64), "{}")
        batch_id = await h.batch("acme", line("a0") + line("a1"), key_hash="f" * 64)
        await h.rounds(1)
        assert (await h.fields("acme", batch_id))["status"] == "in_progress"
        await h.redis.delete(h.names.api_key("f" * 64))
        await h.rounds(3)
        fields = await h.fields("acme", batch_id)
        assert fields["status"] == "cancelled"
        assert fields["cancel_reason"] == "The API key that created the batch was revoked."
        answers = await h.answers("acme", batch_id)
        assert sorted(answers) == [0, 1]
        for answer in answers.values():
            error = answer["error"]
            assert isinstance(error, dict)
            assert error["message"] == "The API key that created the batch was revoked."


async def test_expired_files_are_swept_and_their_bytes_given_back(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        storage = h.keeper.storage
        now = int(time.time())
        for file_id, expires in (("file-old", now - 1), ("file-new", now + 3600)):
            record = FileRecord(
                id=file_id, team="acme", purpose="batch", filename="f", bytes=100, created_at=now,
                key=object_key("acme", file_id), expires_at=expires,
            )  # fmt: skip
            await h.keeper.store.put(record.key, b"x" * 100)
            await storage.take("acme", {FILES: 1, BYTES: 100})
            await save_file_record(h.redis, h.names, record)
        await h.rounds(1)
        assert await h.redis.get(h.names.file_record("acme", "file-old")) is None
        assert await h.redis.get(h.names.file_record("acme", "file-new")) is not None
        assert await h.redis.zrange(h.names.files("acme"), 0, -1) == [b"file-new"]
        assert not (tmp_path / "files" / object_key("acme", "file-old")).exists()
        counts = await h.redis.hgetall(h.names.team_storage("acme"))
        assert {k: int(v) for k, v in counts.items()} == {b"files": 1, b"bytes": 100}


async def test_a_batch_gives_its_caps_back_once_however_often_it_is_retired(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        first = await h.batch("acme", line("a0") + line("a1"))
        await h.batch("acme", line("b0") + line("b1") + line("b2"))

        async def held() -> dict[bytes, int]:
            raw = await h.redis.hgetall(h.names.team_storage("acme"))
            return {k: int(v) for k, v in raw.items() if k in (b"batches", b"batch_lines")}

        assert await held() == {b"batches": 2, b"batch_lines": 5}
        await h.keeper._fail("acme", first, "stopped")
        await h.keeper._retire("acme", first)  # a second keeper retiring it too
        assert await held() == {b"batches": 1, b"batch_lines": 3}


async def test_a_missing_input_object_fails_its_batch_alone(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        lost = await h.batch("mallory", line("p0"))
        healthy = await h.batch("acme", line("a0") + line("a1"))
        file_id = (await h.fields("mallory", lost))["input_file_id"]
        (tmp_path / "files" / object_key("mallory", file_id)).unlink()  # the object alone went away
        await h.rounds(STEP_FAULTS + 2)
        bad = await h.fields("mallory", lost)
        assert bad["status"] == "failed"
        assert "(FileNotFoundError)" in bad["errors"]
        good = await h.fields("acme", healthy)
        assert good["status"] == "in_progress"
        assert good["cursor"] == "2"


async def test_an_expiry_entry_that_cannot_be_removed_is_passed_over(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        now = int(time.time())
        await h.redis.set(h.names.file_record("mallory", "file-bad"), b"not a record")
        await h.redis.zadd(h.names.file_expiry(), {"mallory/file-bad": now - 10})
        record = FileRecord(
            id="file-old", team="acme", purpose="batch", filename="f", bytes=100, created_at=now,
            key=object_key("acme", "file-old"), expires_at=now - 1,
        )  # fmt: skip
        await h.keeper.store.put(record.key, b"x" * 100)
        await save_file_record(h.redis, h.names, record)
        failed_before = ITEMS_FAILED.labels("ingress.file_sweep")._value.get()
        await h.rounds(1)
        assert ITEMS_FAILED.labels("ingress.file_sweep")._value.get() == failed_before + 1
        assert await h.redis.get(h.names.file_record("acme", "file-old")) is None
        assert await h.redis.zrange(h.names.file_expiry(), 0, -1) == []


async def test_result_files_are_counted_once_however_often_they_are_written(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        unknown = b"".join(line(f"u{n}").replace(b"sluice-sim", b"no-such-model") for n in range(3))
        batch_id = await h.batch("acme", unknown)
        await h.rounds(5)
        fields = await h.fields("acme", batch_id)
        assert fields["status"] == "completed"
        assert fields["failed"] == "3"

        async def files_held() -> int:
            return int(await h.redis.hget(h.names.team_storage("acme"), "files") or 0)

        assert await files_held() == 1  # the error file
        # A keeper that died after counting the file, before saving its record: the next one writes it again.
        await h.redis.delete(h.names.file_record("acme", fields["error_file_id"]))
        await h.keeper._write_results("acme", batch_id, fields, int(time.time()))
        assert await h.redis.get(h.names.file_record("acme", fields["error_file_id"])) is not None
        assert await files_held() == 1


async def test_a_cancelled_batch_of_many_lines_is_answered_a_page_at_a_time(bus: Bus, tmp_path: Path) -> None:
    async with harness(bus, tmp_path) as h:
        data = b"".join(line(f"c{n}") for n in range(1200))
        batch_id = await h.batch("acme", data)
        await h.rounds(1)  # validated
        await h.redis.hset(h.names.batch_record("acme", batch_id), "status", "cancelling")
        await h.rounds(3)
        fields = await h.fields("acme", batch_id)
        assert fields["status"] == "cancelled"
        answers = await h.answers("acme", batch_id)
        assert len(answers) == 1200
        assert answers[1199]["custom_id"] == "c1199"


async def test_a_batch_lease_is_claimed_renewed_and_never_taken_from_its_holder(
    bus: Bus, tmp_path: Path
) -> None:
    async with harness(bus, tmp_path) as h:
        keeper = h.keeper
        key = h.names.batch_lease("acme", "batch_x")
        assert await keeper._leased("acme", "batch_x")  # free: claimed
        assert await keeper._leased("acme", "batch_x")  # its own: renewed
        await h.redis.set(key, "another-keeper", px=60_000)
        assert not await keeper._leased("acme", "batch_x")
        assert not await keeper._leased("acme", "batch_x", "renew")
        assert await h.redis.get(key) == b"another-keeper"
        await h.redis.delete(key)
        assert not await keeper._leased("acme", "batch_x", "renew")  # renewing claims nothing
        assert await keeper._leased("acme", "batch_x")
