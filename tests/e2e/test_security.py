"""Abuse and secrets through the real HTTP API: what reaches logs and Redis, what one team's key can reach,
and bodies too large to read."""

from __future__ import annotations

import asyncio
import io
import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from infra.devstack import DevStack, Endpoints
from infra.keys import create_key
from openai_api.admission import new_request_id
from queue_schemas.keys import hash_api_key
from queue_schemas.names import Names
from tests.e2e.conftest import openai_client, team_key

pytestmark = pytest.mark.timeout(180)


def redis_dump(endpoints: Endpoints) -> list[tuple[bytes, bytes]]:
    """Every string key and its value (other types by name only)."""

    async def go() -> list[tuple[bytes, bytes]]:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            out = []
            async for key in redis.scan_iter(count=1000):
                value = await redis.get(key) if await redis.type(key) == b"string" else b""
                raw = value.encode() if isinstance(value, str) else value or b""
                out.append((key, raw))
            return out
        finally:
            await redis.aclose()

    return asyncio.run(go())


def all_logs(stack: DevStack) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(stack.log_dir.glob("*.log")))


LOG_SCAN_POOLS = """
[[pools]]
name = "flaky"           # fails mid-stream: the engine-error path logs
model = "sluice-flaky"
[pools.simulated]
ttft_ms = 5
token_ms = 5
fail_after_tokens = 5

[[pools]]
name = "buggy"           # meets an unexpected exception: the worker logs a traceback
model = "sluice-buggy"
[pools.simulated]
ttft_ms = 5
token_ms = 5
fail_after_tokens = 5
fault_kind = "bug"
"""


def test_no_prompt_completion_or_key_reaches_the_logs(tmp_path: Path) -> None:
    """Read after the stack has stopped, so every line its services wrote (the last ones too) is seen."""
    default = (Path(__file__).parents[2] / "queue_schemas" / "default_pools.toml").read_text()
    config = tmp_path / "pools.toml"
    config.write_text(default + LOG_SCAN_POOLS)
    stack = DevStack(tmp_path / "stack", config_path=config, extra_env={"SLUICE_HEARTBEAT_INTERVAL_S": "0.2"})
    endpoints = stack.start()
    canary = f"canary{secrets.token_hex(8)}"
    try:
        key = team_key(endpoints, "log-scan")
        client = openai_client(endpoints, key)
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": f"system {canary}"},
            {"role": "user", "content": f"tell me about {canary}"},
        ]
        streamed = client.chat.completions.create(
            model="sluice-sim", messages=messages, stream=True, max_tokens=200
        )
        answer = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        whole = client.chat.completions.create(model="sluice-sim", messages=messages, max_tokens=200)
        text = client.completions.create(model="sluice-sim", prompt=f"complete {canary}", max_tokens=200)
        for failing in ("sluice-flaky", "sluice-buggy"):  # their error paths log too
            with pytest.raises(openai.APIError):
                for _ in client.chat.completions.create(model=failing, messages=messages, stream=True):
                    pass
        with pytest.raises(openai.AuthenticationError):
            openai_client(endpoints, f"sk-wrong-{canary}").models.list()
        completions = [answer, whole.choices[0].message.content or "", text.choices[0].text]
        assert all(len(c) >= 20 for c in completions), "answers long enough to be recognised in a log"
    finally:
        stack.stop()
    logs = all_logs(stack)
    assert "request_id=" in logs, "the logs were read and carry request ids"
    assert "Traceback" in logs, "the worker's traceback for the buggy pool was written"
    assert canary not in logs
    assert key not in logs
    for completion in completions:
        assert completion not in logs


def test_api_keys_are_stored_only_as_hashes(dev_stack: tuple[DevStack, Endpoints]) -> None:
    _, endpoints = dev_stack
    key = team_key(endpoints, "hashed")
    dump = redis_dump(endpoints)
    assert any(k == Names().api_key(hash_api_key(key)).encode() for k, _ in dump)
    secret = key.encode()
    assert not [k for k, v in dump if secret in k or secret in v], "the key itself is stored nowhere"


def test_request_ids_are_unguessable() -> None:
    ids = {new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), "128 random bits each"


def test_one_team_cannot_reach_another_teams_requests_or_pools(dev_stack: tuple[DevStack, Endpoints]) -> None:
    _, endpoints = dev_stack

    async def restricted() -> str:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            return await create_key(redis, Names(), "only-sim", pools=("sim",))
        finally:
            await redis.aclose()

    key_a = team_key(endpoints, "team-a")
    key_b = asyncio.run(restricted())
    reply = openai_client(endpoints, key_a).chat.completions.create(
        model="sluice-sim", messages=[{"role": "user", "content": "mine"}]
    )
    # No route addresses a request by id: another team (or the same one) can neither read nor cancel it.
    for method in ("GET", "DELETE", "POST"):
        for path in (f"/v1/chat/completions/{reply.id}", f"/v1/chat/completions/{reply.id}/cancel"):
            response = httpx.request(
                method, endpoints.url + path, headers={"Authorization": f"Bearer {key_b}"}, timeout=10
            )
            assert response.status_code in (404, 405), (method, path, response.status_code)
    # The routes that do take an id are the files', batches', responses' and streams' (unguessable ids,
    # kept per team): each answers another team 404 for a file, a batch, a response and a stream of A.
    client_a = openai_client(endpoints, key_a)
    body = {"model": "sluice-sim", "messages": [{"role": "user", "content": "later"}], "max_tokens": 2}
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    upload = client_a.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    batch = client_a.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    stored = client_a.responses.create(
        model="sluice-slow", input="mine", background=True, max_output_tokens=5
    )
    streamed = list(
        client_a.chat.completions.create(
            model="sluice-sim", messages=[{"role": "user", "content": "mine"}], stream=True, max_tokens=5
        )
    )
    ids = {
        "file_id": upload.id, "batch_id": batch.id, "response_id": stored.id,
        "completion_id": streamed[0].id,
    }  # fmt: skip
    paths = httpx.get(endpoints.url + "/openapi.json", timeout=10).json()["paths"]
    with_id = {(method.upper(), path) for path, ops in paths.items() if "{" in path for method in ops}
    assert with_id == {
        ("GET", "/v1/files/{file_id}"),
        ("DELETE", "/v1/files/{file_id}"),
        ("GET", "/v1/files/{file_id}/content"),
        ("GET", "/v1/batches/{batch_id}"),
        ("POST", "/v1/batches/{batch_id}/cancel"),
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
        ("POST", "/v1/responses/{response_id}/cancel"),
        ("GET", "/v1/responses/{response_id}/input_items"),
        ("GET", "/v1/chat/completions/{completion_id}/stream"),
        ("GET", "/v1/completions/{completion_id}/stream"),
    }
    for method, path in sorted(with_id):
        url = endpoints.url + path.format(**ids)
        response = httpx.request(method, url, headers={"Authorization": f"Bearer {key_b}"}, timeout=10)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    stream = httpx.get(
        endpoints.url + f"/v1/responses/{stored.id}",
        params={"stream": "true", "starting_after": 0},
        headers={"Authorization": f"Bearer {key_b}"},
        timeout=10,
    )
    assert stream.status_code == 404, stream.text
    assert client_a.files.retrieve(upload.id).id == upload.id  # still there for its owner
    assert client_a.responses.retrieve(stored.id).status != "cancelled"

    # A key limited to some pools does not see the others.
    client_b = openai_client(endpoints, key_b)
    assert client_b.chat.completions.create(model="sluice-sim", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as err:
        client_b.chat.completions.create(model="sluice-slow", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    assert "sluice-slow" not in {m.id for m in client_b.models.list()}


def chunks(total: int, size: int) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


def test_oversized_bodies_are_refused_before_they_are_read(dev_stack: tuple[DevStack, Endpoints]) -> None:
    _, endpoints = dev_stack
    headers = {"Authorization": f"Bearer {endpoints.api_key}", "Content-Type": "application/json"}
    url = endpoints.url + "/v1/chat/completions"
    limit = 4 * 1024 * 1024
    declared = httpx.post(url, content=b"{" + b" " * limit + b"}", headers=headers, timeout=30)
    assert declared.status_code == 413
    assert "limit" in declared.json()["error"]["message"]
    # Chunked, with no length announced: refused at the chunk that crosses the limit.
    chunked = httpx.post(url, content=chunks(limit + 65536, 65536), headers=headers, timeout=30)
    assert chunked.status_code == 413
    # Unauthenticated callers are refused before their body is looked at.
    anonymous = httpx.post(url, content=b"{" + b" " * limit + b"}", timeout=30)
    assert anonymous.status_code == 401


def test_the_priority_service_tier_needs_a_key_that_allows_it(dev_stack: tuple[DevStack, Endpoints]) -> None:
    _, endpoints = dev_stack
    plain = openai_client(endpoints, team_key(endpoints, "tiers"))
    message: list[ChatCompletionMessageParam] = [{"role": "user", "content": "now"}]
    with pytest.raises(openai.PermissionDeniedError) as err:
        plain.chat.completions.create(model="sluice-sim", messages=message, service_tier="priority")
    assert err.value.code == "service_tier_not_allowed"
    tiers: tuple[Literal["flex", "default", "auto"], ...] = ("flex", "default", "auto")
    for tier in tiers:
        assert plain.chat.completions.create(model="sluice-sim", messages=message, service_tier=tier).choices
    with pytest.raises(openai.BadRequestError) as bad:
        plain.chat.completions.create(model="sluice-sim", messages=message, service_tier="scale")
    assert "service_tier" in str(bad.value)
    allowed = openai_client(endpoints, team_key(endpoints, "tiers", allow_priority=True))
    reply = allowed.chat.completions.create(model="sluice-sim", messages=message, service_tier="priority")
    assert reply.choices[0].message.content


def test_slo_headers_are_honoured_or_refused_by_name(dev_stack: tuple[DevStack, Endpoints]) -> None:
    """The official client's extra headers: a request's own latency objectives (llm-d's header names)
    are accepted; a malformed one is a 400 naming the header, before anything is queued."""
    _, endpoints = dev_stack
    client = openai_client(endpoints, team_key(endpoints, "slo"))
    message: list[ChatCompletionMessageParam] = [{"role": "user", "content": "soon"}]
    slo = {"x-slo-ttft-ms": "30000", "x-slo-tpot-ms": "1000"}
    reply = client.chat.completions.create(model="sluice-sim", messages=message, extra_headers=slo)
    assert reply.choices[0].message.content
    for bad in ("soon", "0", "600001"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="sluice-sim", messages=message, extra_headers={"x-slo-ttft-ms": bad}
            )
        assert err.value.code == "invalid_slo"
        assert "x-slo-ttft-ms" in str(err.value)
