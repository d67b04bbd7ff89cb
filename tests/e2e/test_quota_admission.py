"""Quotas and admission control through the real HTTP API."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from infra.devstack import Endpoints
from queue_schemas.messages import POOL_STATE_STALE_S
from queue_schemas.teams import TeamLimits
from tests.e2e.conftest import day_used, openai_client, pool_state, team_key
from tests.e2e.test_streaming_contract import chat_prompt_ids
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_429_is_retried_after_retry_after(endpoints: Endpoints) -> None:
    tpm = 6000  # 100 tokens per second
    key = team_key(endpoints, "retry", TeamLimits(tokens_per_minute=tpm))
    statuses: list[int] = []
    with openai.DefaultHttpxClient(
        event_hooks={"response": [lambda r: statuses.append(r.status_code)]}
    ) as http:
        waited = hold_tokens_then_retry(endpoints, key, tpm, http)
    assert statuses[1] == 429, statuses
    assert statuses[-1] == 200
    assert waited >= 0.9, "the client must have slept for Retry-After (about 1.2 s) before retrying"


def hold_tokens_then_retry(
    endpoints: Endpoints, key: str, tpm: int, http: openai.DefaultHttpxClient
) -> float:
    """Hold almost a minute's tokens with a stream left open, then ask again; return how long that took."""
    client = openai_client(endpoints, key, max_retries=2, http_client=http)
    prompt = len(chat_prompt_ids(MESSAGES))
    hog = client.chat.completions.create(
        model="sluice-slow", messages=MESSAGES, stream=True, max_tokens=tpm - prompt - 40
    )
    started = time.monotonic()
    done = client.chat.completions.create(model="sluice-sim", messages=MESSAGES, max_tokens=100)
    waited = time.monotonic() - started
    hog.close()
    assert done.choices[0].message.content
    return waited


def test_429_carries_rate_limit_headers(endpoints: Endpoints) -> None:
    key = team_key(endpoints, "headers", TeamLimits(requests_per_minute=1, tokens_per_minute=100_000))
    url = endpoints.url + "/v1/chat/completions"
    body = {"model": "sluice-sim", "messages": MESSAGES, "max_tokens": 3}
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "1"
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert ok.headers["x-ratelimit-limit-tokens"] == "100000"
    refused = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")


def test_concurrent_requests_never_exceed_the_daily_budget(endpoints: Endpoints) -> None:
    max_tokens = 20
    cost = len(chat_prompt_ids(MESSAGES)) + max_tokens
    budget = 12 * cost + cost // 2
    key = team_key(endpoints, "budget", TeamLimits(daily_tokens=budget))

    async def fire() -> list[object]:
        client = openai.AsyncOpenAI(base_url=endpoints.url + "/v1", api_key=key, max_retries=0)
        try:
            calls = [
                client.chat.completions.create(model="sluice-sim", messages=MESSAGES, max_tokens=max_tokens)
                for _ in range(50)
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await client.close()

    results = asyncio.run(fire())
    done = [r for r in results if isinstance(r, openai.types.chat.ChatCompletion)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(done) + len(refused) == 50, [
        r for r in results if not isinstance(r, openai.types.chat.ChatCompletion)
    ]
    assert len(done) == 12, "exactly floor(budget / reserved cost) requests fit"
    assert all(r.code == "insufficient_quota" for r in refused)
    real = sum(r.usage.total_tokens for r in done if r.usage is not None)
    assert real <= budget
    assert day_used(endpoints, "budget") == real, "the budget is settled to the real usage"


def test_pool_without_workers_is_refused_quickly(endpoints: Endpoints) -> None:
    def fresh_state() -> bool:
        # The gate stays open while the scaler has said nothing of the pool (or not for POOL_STATE_STALE_S):
        # a request admitted then would wait in the queue, so the test waits for a recent state first.
        state = pool_state(endpoints, "empty")
        return state is not None and time.time() - state.updated_at < POOL_STATE_STALE_S / 2

    until(fresh_state, 60, "the scaler publishes the empty pool's state")
    url = endpoints.url + "/v1/chat/completions"
    body = {"model": "sluice-empty", "messages": MESSAGES, "max_tokens": 3}
    try:
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {endpoints.api_key}"}, timeout=30)
    except httpx.TimeoutException as exc:  # say what the gate could have read, and whether it refused
        state = pool_state(endpoints, "empty")
        metrics = httpx.get(endpoints.url + "/metrics", timeout=30).text.splitlines()
        refused = [m for m in metrics if m.startswith("sluice_ingress_rejections_total") and "empty" in m]
        raise AssertionError(f"no answer in 30 s; at {time.time():.3f}: {state!r}, {refused}") from exc
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_workers"
    assert int(r.headers["retry-after"]) > 0


def cli(endpoints: Endpoints, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLUICE_REDIS_URL": endpoints.redis_url}
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "keys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_cli_create_list_limits_revoke(endpoints: Endpoints) -> None:
    created = cli(endpoints, "create", "--team", "cli-team", "--pool", "sim", "--rpm", "100")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("sk-sluice-")
    listing = cli(endpoints, "list").stdout
    row = next(line for line in listing.splitlines() if line.startswith("cli-team\t"))
    key_id = row.split("\t")[1]
    assert key not in listing, "listings show key ids, never keys"
    assert row.split("\t")[2] == "sim"
    assert "rpm=100" in cli(endpoints, "limits", "--team", "cli-team").stdout
    weighted = cli(endpoints, "limits", "--team", "cli-team", "--weight", "2.5").stdout
    assert "rpm=100" in weighted, "setting the weight keeps the limits"
    assert "weight=2.5" in weighted
    assert cli(endpoints, "limits", "--team", "cli-team", "--weight", "0").returncode != 0
    assert "weight=2.5" in cli(endpoints, "limits", "--team", "cli-team").stdout
    urgent = cli(endpoints, "create", "--team", "cli-team", "--allow-priority").stdout.strip()
    rows = [line.split("\t") for line in cli(endpoints, "list").stdout.splitlines()]
    assert [r[3:] for r in rows if r[1] == urgent[: len(key_id)]] == [["priority"]]
    assert [r[3:] for r in rows if r[1] == key_id] == [[]]

    client = openai_client(endpoints, key)
    assert [m.id for m in client.models.list()] == ["sluice-sim"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="sluice-slow", messages=MESSAGES, max_tokens=2)

    assert cli(endpoints, "revoke", key_id).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert cli(endpoints, "revoke", key_id).returncode == 1
