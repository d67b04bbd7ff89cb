"""OpenAI's Files and Batch APIs through the official client: upload, create, poll, download; cancel;
the keeper and collector (in the ingress) killed mid-batch; and the 4xx answers to bad input."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import redis.asyncio as aioredis
from openai.types import Batch

from gpu_workers.simulated import answer_to
from infra.devstack import DevStack, Endpoints
from infra.keys import create_key
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.names import Names
from tests.e2e.conftest import openai_client, team_key

pytestmark = pytest.mark.timeout(300)

FINAL = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str, model: str = "sluice-sim", **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 16, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def expected_text(content: str, max_tokens: int = 16) -> str:
    """What the simulated engine answers to one user message (one byte per token)."""
    prompt = ByteTokenizer().encode_chat([ChatMessage(role="user", content=content)])
    return answer_to(prompt)[:max_tokens]


def wait_for(client: openai.OpenAI, batch_id: str, done: Callable[[Batch], bool], timeout_s: float) -> Batch:
    """Poll the batch until `done`, riding out an ingress that is restarting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
            if done(batch):
                return batch
        except (openai.APIConnectionError, openai.InternalServerError):
            pass
        assert time.monotonic() < deadline, f"batch {batch_id} not done in {timeout_s}s"
        time.sleep(0.3)


def declare_upload(endpoints: Endpoints, key: str, length: int) -> tuple[int, dict[str, Any]]:
    """An upload that declares `length` bytes and sends none: the answer comes from the headers alone."""
    url = urlsplit(endpoints.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/files")
        conn.putheader("authorization", f"Bearer {key}")
        conn.putheader("content-type", "multipart/form-data; boundary=x")
        conn.putheader("content-length", str(length))
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())["error"]
    finally:
        conn.close()


def read_file(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Batch:
    upload = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert upload.purpose == "batch"
    assert upload.bytes == len(jsonl(lines))
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"job": "nightly"},
    )  # fmt: skip
    assert batch.status == "validating"
    assert batch.input_file_id == upload.id
    return batch


def test_a_200_line_batch_runs_through_the_official_client(endpoints: Endpoints) -> None:
    client = openai_client(endpoints, team_key(endpoints, "batch-api"))
    good = [chat_line(f"q-{n}", f"Question number {n}?") for n in range(190)]
    refused = [chat_line(f"hot-{n}", "Too hot", temperature=5) for n in range(6)]
    unknown = [chat_line(f"nomodel-{n}", "Who?", model="no-such-model") for n in range(4)]
    lines = good + refused + unknown
    batch = run_batch(client, lines)
    done = wait_for(client, batch.id, lambda b: b.status in FINAL, timeout_s=180)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        200,
        190,
        10,
    )
    assert done.metadata == {"job": "nightly"}
    assert done.in_progress_at
    assert done.finalizing_at
    assert done.completed_at
    output, errors = read_file(client, done.output_file_id), read_file(client, done.error_file_id)
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each answered exactly once
    for line in output:
        n = int(line["custom_id"].removeprefix("q-"))
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200
        assert line["error"] is None
        assert body["choices"][0]["message"]["content"] == expected_text(f"Question number {n}?")
        assert body["usage"]["completion_tokens"] == 16
    codes = {line["custom_id"]: line["response"]["status_code"] for line in errors}
    assert codes == {**{f"hot-{n}": 400 for n in range(6)}, **{f"nomodel-{n}": 404 for n in range(4)}}
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert client.files.retrieve(done.output_file_id or "").purpose == "batch_output"
    with pytest.raises(openai.BadRequestError, match="status 'completed'"):
        client.batches.cancel(batch.id)


def test_a_cancelled_batch_ends_cancelled_with_counts_that_add_up(endpoints: Endpoints) -> None:
    client = openai_client(endpoints, team_key(endpoints, "batch-cancel"))
    # The slow pool takes about 400 ms to start a request and 40 ms a token: 60 lines take a while.
    lines = [chat_line(f"s-{n}", f"Slow question {n}", model="sluice-slow", max_tokens=30) for n in range(60)]
    batch = run_batch(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts is not None and b.request_counts.completed > 0, 120)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, lambda b: b.status in FINAL, timeout_s=120)
    assert done.status == "cancelled"
    assert done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None
    assert counts.total == 60
    assert 0 < counts.completed < 60
    assert counts.completed + counts.failed == 60
    output, errors = read_file(client, done.output_file_id), read_file(client, done.error_file_id)
    assert len(output) == counts.completed
    assert len(errors) == counts.failed
    assert sorted(line["custom_id"] for line in output + errors) == sorted(f"s-{n}" for n in range(60))
    assert {line["error"]["code"] for line in errors} == {"cancelled"}


def test_a_batch_survives_its_keeper_and_collector_being_killed(
    dev_stack: tuple[DevStack, Endpoints],
) -> None:
    stack, endpoints = dev_stack
    client = openai_client(endpoints, team_key(endpoints, "batch-restart"))
    lines = [
        chat_line(f"r-{n}", f"Restart question {n}", model="sluice-slow", max_tokens=24) for n in range(80)
    ]
    batch = run_batch(client, lines)
    started = wait_for(
        client, batch.id, lambda b: b.request_counts is not None and b.request_counts.completed >= 5, 120
    )
    stack.restart("ingress", kill=True)  # keeper, collector and usage relay die with it (SIGKILL)
    # Read just before the kill: answers were still to be collected (each line takes about 1.4 s on the
    # slow pool, and the first ones had just come in).
    assert started.request_counts is not None
    assert started.request_counts.completed < 80, "the kill came while lines were still unanswered"
    done = wait_for(client, batch.id, lambda b: b.status in FINAL, timeout_s=240)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (80, 0)
    output = read_file(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"r-{n}" for n in range(80))
    for line in output:
        n = int(line["custom_id"].removeprefix("r-"))
        assert line["response"]["body"]["choices"][0]["message"]["content"] == expected_text(
            f"Restart question {n}", 24
        )
    assert done.error_file_id is None


def test_bad_input_gets_openai_shaped_errors(endpoints: Endpoints) -> None:
    key = team_key(endpoints, "batch-bad")
    client = openai_client(endpoints, key)
    other = openai_client(endpoints, team_key(endpoints, "batch-other"))
    bad_files = {
        b"not json\n": "not valid JSON",
        jsonl([chat_line("a", "x"), chat_line("a", "y")]): "appears more than once",
        jsonl([{**chat_line("a", "x"), "url": "/v1/embeddings"}]): "url must be one of",
        jsonl([{**chat_line("a", "x"), "method": "GET"}]): "method must be POST",
        b"": "holds no requests",
    }
    for data, message in bad_files.items():
        with pytest.raises(openai.BadRequestError) as err:
            client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
        assert message in str(err.value), data
        assert err.value.code == "invalid_file"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl([chat_line("a", "x")]))), purpose="fine-tune")
    upload = client.files.create(file=("ok.jsonl", io.BytesIO(jsonl([chat_line("a", "x")]))), purpose="batch")
    # Another team sees neither the file nor a batch made from it.
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert upload.id not in [f.id for f in other.files.list()]
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in other.batches.list()]
    # Oversized: refused from the declared length, before the body is read.
    status, error = declare_upload(endpoints, key, 300 * 1024 * 1024)
    assert status == 413
    assert error["code"] == "request_too_large"
    # A batch whose lines name an endpoint other than its own fails validation with the line.
    mixed = client.files.create(
        file=(
            "mixed.jsonl",
            io.BytesIO(jsonl([chat_line("a", "x"), {**chat_line("b", "y"), "url": "/v1/completions"}])),
        ),
        purpose="batch",
    )
    failed = client.batches.create(
        input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_for(client, failed.id, lambda b: b.status in FINAL, timeout_s=30)
    assert failed.status == "failed"
    assert failed.errors is not None
    assert failed.errors.data
    assert failed.errors.data[0].line == 2
    deleted = client.files.delete(upload.id)
    assert deleted.deleted
    assert deleted.id == upload.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_a_batch_uses_only_the_pools_its_key_may(endpoints: Endpoints) -> None:
    async def restricted_key() -> str:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            return await create_key(redis, Names(), "batch-pools", pools=("slow",))
        finally:
            await redis.aclose()

    client = openai_client(endpoints, asyncio.run(restricted_key()))
    lines = [chat_line("allowed", "Fine", model="sluice-slow"), chat_line("other-pool", "Not mine")]
    batch = run_batch(client, lines)
    done = wait_for(client, batch.id, lambda b: b.status in FINAL, timeout_s=60)
    assert done.status == "completed"
    assert [line["custom_id"] for line in read_file(client, done.output_file_id)] == ["allowed"]
    (refused,) = read_file(client, done.error_file_id)
    assert refused["custom_id"] == "other-pool"
    assert refused["response"]["status_code"] == 404
    assert refused["response"]["body"]["error"]["code"] == "model_not_found"
