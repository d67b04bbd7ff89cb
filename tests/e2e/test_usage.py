"""Usage records on the usage topic after a mixed run (streamed, non-streamed, cancelled, failed, batch):
one per request, and what they say was charged is what the team's quota counter was charged."""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import time

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from infra.devstack import Endpoints
from infra.usage_cli import read_usage
from ingress.batches.api import line_request_id
from queue_schemas.batch import internal_request_id
from queue_schemas.keys import key_id
from queue_schemas.settings import BusSettings
from queue_schemas.usage import UsageEvent
from tests.e2e.conftest import day_used, openai_client, team_key
from tests.e2e.test_batch_api import chat_line, run_batch, wait_for

pytestmark = pytest.mark.timeout(240)

TEAM = "usage-mix"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count the queues."}]


def usage_for(endpoints: Endpoints, request_ids: set[str], timeout_s: float = 60) -> list[UsageEvent]:
    """The usage records of the team, once every one of `request_ids` has its record."""
    settings = BusSettings(kafka_bootstrap=endpoints.kafka_bootstrap, redis_url=endpoints.redis_url)
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e for e in asyncio.run(read_usage(settings)) if e.team == TEAM]
        missing = request_ids - {e.request_id for e in events}
        if not missing:
            return events
        assert time.monotonic() < deadline, f"no usage record for {sorted(missing)}"
        time.sleep(0.5)


def test_usage_records_match_what_the_quota_charged(endpoints: Endpoints) -> None:
    key = team_key(endpoints, TEAM)
    client = openai_client(endpoints, key)
    ids: dict[str, str] = {}  # request id -> what it was
    streamed = list(
        client.chat.completions.create(
            model="sluice-sim",
            messages=MESSAGES,
            stream=True,
            max_tokens=20,
            stream_options={"include_usage": True},
        )
    )
    ids[streamed[0].id.removeprefix("chatcmpl-")] = "streamed"
    plain = client.chat.completions.create(model="sluice-sim", messages=MESSAGES, max_tokens=20)
    ids[plain.id.removeprefix("chatcmpl-")] = "plain"
    cut = client.chat.completions.create(model="sluice-slow", messages=MESSAGES, stream=True, max_tokens=200)
    got = ""
    for first in cut:
        got += first.choices[0].delta.content or ""
        if len(got) >= 3:  # the request is running on a worker
            break
    cut.close()
    ids[first.id.removeprefix("chatcmpl-")] = "cancelled"  # the client went away
    flaky = client.chat.completions.create(
        model="sluice-flaky",
        messages=MESSAGES,
        stream=True,
        max_tokens=50,
    )
    seen: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIError):
        seen.extend(flaky)  # the pool's engine fails after 5 tokens
    ids[seen[0].id.removeprefix("chatcmpl-")] = "failed"
    batch = run_batch(client, [chat_line(f"b-{n}", f"Batch line {n}") for n in range(3)])
    done = wait_for(client, batch.id, lambda b: b.status == "completed", timeout_s=60)
    assert done.request_counts is not None
    assert done.request_counts.completed == 3
    for n in range(3):
        ids[internal_request_id(TEAM, line_request_id(TEAM, batch.id, n))] = "batch"

    events = usage_for(endpoints, set(ids))
    counts = collections.Counter(e.request_id for e in events)
    assert {rid: counts[rid] for rid in ids} == dict.fromkeys(ids, 1)
    by_id = {e.request_id: e for e in events}
    status = {what: by_id[rid].status.value for rid, what in ids.items()}
    assert status == {
        "streamed": "completed", "plain": "completed", "cancelled": "cancelled", "failed": "failed",
        "batch": "completed",
    }, {what: by_id[rid] for rid, what in ids.items()}  # fmt: skip
    assert {by_id[rid].kind for rid, what in ids.items() if what == "batch"} == {"batch"}
    assert {by_id[rid].key_id for rid in ids} == {key_id(key)}
    assert by_id[next(r for r, w in ids.items() if w == "failed")].error_code == "engine_error"
    usage = streamed[-1].usage
    assert usage is not None
    event = by_id[next(iter(ids))]
    assert (event.prompt_tokens, event.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert event.ttft_s is not None
    assert event.queue_s is not None
    assert 0 <= event.queue_s <= event.ttft_s <= event.total_s
    cancelled = by_id[next(r for r, w in ids.items() if w == "cancelled")]
    assert 0 < cancelled.completion_tokens < 200

    # What the records say was charged is what the quota counter holds (the cancelled request settles
    # once its worker has stopped it, so the two are compared until they agree).
    deadline = time.monotonic() + 30
    while sum(e.charged_tokens for e in usage_for(endpoints, set(ids))) != day_used(endpoints, TEAM):
        assert time.monotonic() < deadline, "usage records and the quota counter disagree"
        time.sleep(0.5)
    charged = day_used(endpoints, TEAM)
    assert charged > 0

    env = dict(os.environ)
    env.update(SLUICE_KAFKA_BOOTSTRAP=endpoints.kafka_bootstrap, SLUICE_REDIS_URL=endpoints.redis_url)
    out = subprocess.run(
        [sys.executable, "-m", "infra.cli", "usage", "--team", TEAM, "--since", "1d", "--by", "model"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"sluice-sim", "sluice-slow", "sluice-flaky", "total"}
    assert rows["total"][1] == str(len(ids))
    assert rows["total"][5] == f"{charged:,}"
    assert rows["sluice-sim"][1] == "5"
