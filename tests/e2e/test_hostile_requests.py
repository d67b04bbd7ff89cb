"""Requests built to hurt the service, through the real HTTP API: each gets a clear error or a bounded
answer, and the pool keeps serving."""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from infra.devstack import Endpoints
from queue_schemas.names import Names
from queue_schemas.teams import TeamLimits
from tests.e2e.conftest import openai_client, team_key

pytestmark = pytest.mark.timeout(120)


def post(endpoints: Endpoints, key: str, body: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(endpoints.url + "/v1/chat/completions", content=body, headers=headers, timeout=60)


def chat_body(**fields: object) -> dict[str, object]:
    return {"model": "sluice-sim", "messages": [{"role": "user", "content": "hello"}], **fields}


def test_a_schema_asking_for_a_billion_characters_is_cut_at_max_tokens(endpoints: Endpoints) -> None:
    client = openai_client(endpoints, team_key(endpoints, "huge-schema"))
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1_000_000_000}},
        "required": ["s"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "huge", "schema": schema}}
    answer = client.chat.completions.create(  # type: ignore[call-overload]
        model="sluice-sim",
        messages=[{"role": "user", "content": "a long string"}],
        max_tokens=30,
        response_format=fmt,
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 30
    assert (answer.choices[0].message.content or "").startswith('{"s": "')
    after = client.chat.completions.create(
        model="sluice-sim", messages=[{"role": "user", "content": "still there?"}], max_tokens=5
    )
    assert after.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("raw_seed", "param"),
    [(str(2**70), "seed"), (str(-(2**63) - 1), "seed"), ("7" * 5000, None)],
    ids=["2**70", "below-int64", "5000-digits"],
)
def test_seeds_outside_64_bits_are_refused(endpoints: Endpoints, raw_seed: str, param: str | None) -> None:
    body = json.dumps(chat_body(seed=0)).replace('"seed": 0', f'"seed": {raw_seed}').encode()
    response = post(endpoints, endpoints.api_key, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert raw_seed[:50] not in error["message"]


def test_the_largest_int64_seed_is_served(endpoints: Endpoints) -> None:
    response = post(
        endpoints, endpoints.api_key, json.dumps(chat_body(seed=2**63 - 1, max_tokens=3)).encode()
    )
    assert response.status_code == 200, response.text


def test_a_user_message_with_null_content_is_refused(endpoints: Endpoints) -> None:
    body = {"model": "sluice-sim", "messages": [{"role": "user", "content": None}]}
    response = post(endpoints, endpoints.api_key, json.dumps(body).encode())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages.0.content"
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = {
        "model": "sluice-sim",
        "max_tokens": 3,
        "messages": [
            {"role": "user", "content": "call f"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ],
    }
    assert post(endpoints, endpoints.api_key, json.dumps(ok).encode()).status_code == 200


def test_a_key_whose_team_record_is_gone_is_refused(endpoints: Endpoints) -> None:
    key = team_key(endpoints, "vanished")
    body = json.dumps(chat_body(max_tokens=3)).encode()
    assert post(endpoints, key, body).status_code == 200

    async def drop_team() -> None:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            await redis.delete(Names().team("vanished"))
        finally:
            await redis.aclose()

    asyncio.run(drop_team())
    response = post(endpoints, key, body)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "unknown_team"


def cached_tokens(client: openai.OpenAI, model: str, prompt: str) -> int:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=2
    )
    assert reply.usage is not None
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


@pytest.mark.parametrize(("model", "shared"), [("sluice-private", False), ("sluice-shared", True)])
def test_a_team_cannot_see_another_teams_cached_prefix(
    endpoints: Endpoints, model: str, shared: bool
) -> None:
    """Per-team isolation by default; a pool that opts into sharing reuses across teams. Each pool has
    one worker, so every request meets the cache the first one filled (with several, a repeat sent
    before the worker's KV events reach the dispatcher may be placed elsewhere)."""
    prompt = f"{secrets.token_hex(8)} " + "a long shared instruction block. " * 40
    team_a = openai_client(endpoints, team_key(endpoints, f"cache-a-{int(shared)}"))
    team_b = openai_client(endpoints, team_key(endpoints, f"cache-b-{int(shared)}"))
    first, repeat = cached_tokens(team_a, model, prompt), cached_tokens(team_a, model, prompt)
    other = cached_tokens(team_b, model, prompt)
    assert first == 0
    assert repeat > 1000, "a team's own repeat is served from the cache"
    assert other == (repeat if shared else 0)


def test_the_rate_gate_comes_before_schema_checks(endpoints: Endpoints) -> None:
    """A key at its request limit gets 429 even for a body whose schemas would take work to check."""
    key = team_key(endpoints, "gate-first", TeamLimits(requests_per_minute=1))
    assert post(endpoints, key, json.dumps(chat_body(max_tokens=2)).encode()).status_code == 200
    invalid = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": invalid}}
    limited = post(endpoints, key, json.dumps(chat_body(max_tokens=2, response_format=fmt)).encode())
    assert limited.status_code == 429, limited.text
    # With room under the limit, the same schema is refused by the check itself.
    fresh = team_key(endpoints, "gate-first-room")
    refused = post(endpoints, fresh, json.dumps(chat_body(max_tokens=2, response_format=fmt)).encode())
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "response_format.json_schema.schema"


def test_schema_sizes_are_bounded_per_schema_and_per_request(endpoints: Endpoints) -> None:
    def tool(i: int, props: int) -> dict[str, object]:
        properties = {f"p{j:05d}": {"type": "string", "description": "x" * 40} for j in range(props)}
        parameters = {"type": "object", "properties": properties}
        return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}

    big = post(endpoints, endpoints.api_key, json.dumps(chat_body(tools=[tool(0, 1500)])).encode())
    assert big.status_code == 400, big.text
    assert big.json()["error"]["param"] == "tools.0.function.parameters"
    many = post(
        endpoints, endpoints.api_key, json.dumps(chat_body(tools=[tool(i, 700) for i in range(6)])).encode()
    )
    assert many.status_code == 400, many.text
    assert many.json()["error"]["param"] == "tools"
    assert "total" in many.json()["error"]["message"]
