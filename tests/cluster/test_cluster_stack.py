"""The whole path on a Redis Cluster: streamed chats through two ingresses, quotas, a signed batch, a
background response's stream resumed through the other ingress (after its client, or its ingress, was
cut), a dispatcher killed under load, and a primary that fails over under open streams (the failed
primary comes back as a replica, so no test depends on running before or after it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from openai.types.chat import ChatCompletionMessageParam
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from infra.devstack import DevStack, Endpoints
from infra.keys import create_key, set_team_limits
from infra.launcher import slot_ranges
from plumbing.protocol.quota import utc_day
from queue_schemas.names import Names
from queue_schemas.teams import TeamLimits
from tests.cluster.conftest import with_cluster
from tests.e2e.test_responses import expected_text, read_until, resume
from tests.e2e.test_streaming_contract import chat_prompt_ids, sim_reply
from tests.waiting import eventually, until

pytestmark = pytest.mark.timeout(300)  # above the dev stack's own start limit, which reports the logs

Stack = tuple[DevStack, Endpoints]


def messages(n: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"question number {n} on the cluster"}]


async def stream_one(
    url: str, key: str, model: str, n: int, max_tokens: int, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One streamed chat with the official client: its id, text, usage, or the error that ended it, and
    when it started and ended (monotonic). `out`, when given, is filled as the stream goes."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    out = {} if out is None else out
    out.update(n=n, text="", id=None, usage=None, error=None, started=time.monotonic(), ended=None)
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages(n), stream=True, max_tokens=max_tokens,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            out["id"] = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                out["text"] += chunk.choices[0].delta.content
            if chunk.usage is not None:
                out["usage"] = chunk.usage.total_tokens
    except openai.APIError as exc:
        out["error"] = str(exc)
    finally:
        out["ended"] = time.monotonic()
        await client.close()
    return out


async def stream_many(
    stack: DevStack, key: str, model: str, count: int, max_tokens: int, spacing_s: float = 0.0
) -> list[dict[str, Any]]:
    """`count` streams, alternating between the ingress processes."""
    urls = stack.ingress_urls
    tasks = []
    for n in range(count):
        tasks.append(asyncio.create_task(stream_one(urls[n % len(urls)], key, model, n, max_tokens)))
        await asyncio.sleep(spacing_s)
    return list(await asyncio.gather(*tasks))


def fresh_key(endpoints: Endpoints, team: str, limits: TeamLimits | None = None) -> str:
    async def go(redis: aioredis.Redis) -> str:
        if limits is not None:
            await set_team_limits(redis, Names(), team, limits)
        return await create_key(redis, Names(), team)

    return with_cluster(endpoints, go)


def charged_today(endpoints: Endpoints, team: str) -> int:
    async def go(redis: aioredis.Redis) -> int:
        return int(await redis.get(Names().quota_day(team, utc_day(time.time()))) or 0)

    return with_cluster(endpoints, go)


def primaries_of(endpoints: Endpoints, request_ids: list[str]) -> dict[str, str]:
    """The primary (host:port) that carries each request's stream channel."""

    async def go(redis: aioredis.Redis) -> dict[str, str]:
        client: Any = redis
        assert isinstance(client, RedisCluster)
        await client.initialize()
        found = {}
        for rid in request_ids:
            node = client.get_node_from_key(Names().stream_channel(rid))
            assert node is not None
            found[rid] = node.name
        return found

    return with_cluster(endpoints, go)


def assert_exact(results: list[dict[str, Any]], max_tokens: int) -> None:
    for r in results:
        assert r["error"] is None, f"stream {r['n']} failed: {r['error']}"
        assert r["text"] == sim_reply(chat_prompt_ids(messages(r["n"])), max_tokens), f"stream {r['n']}"


def test_streams_through_two_ingresses_over_three_shards(cluster_stack: Stack) -> None:
    stack, endpoints = cluster_stack
    assert len(stack.ingress_urls) == 2
    key = fresh_key(endpoints, "spread")
    results = asyncio.run(stream_many(stack, key, "sluice-sim", 24, 24))
    assert_exact(results, 24)
    request_ids = [r["id"].removeprefix("chatcmpl-") for r in results]
    shards = set(primaries_of(endpoints, request_ids).values())
    assert len(shards) == 3, f"24 streams should land on every primary, got {shards}"
    assert charged_today(endpoints, "spread") == sum(r["usage"] for r in results)


def test_quota_on_the_cluster(cluster_stack: Stack) -> None:
    stack, endpoints = cluster_stack
    key = fresh_key(endpoints, "capped", TeamLimits(tokens_per_minute=200))
    client = openai.OpenAI(base_url=stack.ingress_urls[1] + "/v1", api_key=key, max_retries=0)
    try:
        first = client.chat.completions.create(model="sluice-sim", messages=messages(1), max_tokens=100)
        assert first.usage is not None
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="sluice-sim", messages=messages(2), max_tokens=150)
        assert refused.value.code == "rate_limit_exceeded"
    finally:
        client.close()
    assert charged_today(endpoints, "capped") == first.usage.total_tokens, "settled to what was used"


def test_signed_batch_on_the_cluster(cluster_stack: Stack, tmp_path: Path) -> None:
    stack, _ = cluster_stack
    rows = [
        {"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "sluice-sim", "messages": messages(n), "max_tokens": 16}}
        for n in range(6)
    ]  # fmt: skip
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env_lines = (stack.workdir / "dev.env").read_text().splitlines()
    env = {**os.environ, **dict(line.split("=", 1) for line in env_lines if "=" in line)}
    argv = [sys.executable, "-m", "infra.cli", "batch", "submit", str(source), "--team", "dev"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in (tmp_path / "requests.output.jsonl").open()]
    assert sorted(line["custom_id"] for line in lines) == [f"line-{n}" for n in range(6)]
    for line in lines:
        n = int(line["custom_id"].split("-")[1])
        content = line["response"]["body"]["choices"][0]["message"]["content"]
        assert content == sim_reply(chat_prompt_ids(messages(n)), 16)


@pytest.mark.parametrize("cut", ["client", "ingress"])
def test_a_background_stream_cut_mid_way_resumes_through_the_other_ingress(
    cluster_stack: Stack, cut: str
) -> None:
    """A background response streamed through the second ingress is cut after a few events: the
    client drops the connection, or the ingress process is killed under it. Its stream is read again
    through the first ingress after the last event seen: nothing lost or repeated, and the text is an
    uninterrupted run's."""
    stack, endpoints = cluster_stack
    key = fresh_key(endpoints, f"resume-{cut}")
    near, far = (openai.OpenAI(base_url=u + "/v1", api_key=key, max_retries=0) for u in stack.ingress_urls)
    question = f"Resume after the {cut} is gone."
    stream = far.responses.create(
        model="sluice-slow", input=question, background=True, max_output_tokens=60, stream=True
    )
    response_id, last, before = read_until(stream, 8)
    if cut == "ingress":
        stack.halt("ingress-2", kill=True)
    stream.close()
    try:
        after, events = resume(near, response_id, last)
    finally:
        if cut == "ingress":
            stack.resume("ingress-2")
    assert [e.sequence_number for e in events] == list(range(last + 1, last + 1 + len(events)))
    assert events[-1].type == "response.incomplete"
    assert before + after == expected_text(question, 60)
    assert near.responses.retrieve(response_id).output_text == before + after
    assert events[-1].response.usage is not None
    assert charged_today(endpoints, f"resume-{cut}") == events[-1].response.usage.total_tokens
    if cut == "ingress":  # back, as a supervisor would restart it, and serving the same response
        until(lambda: _healthy(stack.ingress_urls[1]), 120, "the restarted ingress")
        assert far.responses.retrieve(response_id).output_text == before + after


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _partitions_of(bootstrap: str, topic: str, request_ids: set[str]) -> dict[str, int]:
    """The partition of the topic each request's record is on."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    found: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 30
        while len(found) < len(request_ids) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for record in records:
                    rid = json.loads(record.value)["request_id"]
                    if rid in request_ids:
                        found[rid] = tp.partition
    finally:
        await consumer.stop()
    return found


def _lease_holder(stack: DevStack, endpoints: Endpoints, pool: str, partition: int) -> str:
    """The name of the dispatcher process that holds the lease on a partition of the pool's topic."""
    names = Names()
    key = names.partition_lease(pool).format(topic=names.requests_topic(pool), partition=partition)

    async def go(redis: aioredis.Redis) -> bytes | None:
        raw = await redis.get(key)
        return raw if raw is None or isinstance(raw, bytes) else raw.encode()

    holder = with_cluster(endpoints, go)
    assert holder is not None, f"no dispatcher holds {key}"
    pid = int(holder.decode().split("-")[1])  # dispatcher-<pid>-<random>
    (name,) = [p.name for p in stack.processes if p.popen.pid == pid]
    return name


def _request_id(result: dict[str, Any]) -> str:
    return str(result["id"]).removeprefix("chatcmpl-")


def test_kill_a_dispatcher_under_streams(cluster_stack: Stack) -> None:
    """Streams over both ingresses while the dispatcher that holds their partition is killed: those
    placed before it died go on, those sent after wait for the other dispatcher to take the partition
    over. Every stream ends once, with exactly its answer, and the team is charged once per request."""
    stack, endpoints = cluster_stack
    key = fresh_key(endpoints, "survivor")
    topic = Names().requests_topic("slow")
    urls = stack.ingress_urls
    # The team's requests share their first block, so they share a partition: find it and its holder.
    probe = asyncio.run(stream_one(urls[0], key, "sluice-slow", 99, 4))
    assert probe["error"] is None, probe
    partition = asyncio.run(_partitions_of(endpoints.kafka_bootstrap, topic, {_request_id(probe)}))
    victim = _lease_holder(stack, endpoints, "slow", partition[_request_id(probe)])

    async def go() -> tuple[list[dict[str, Any]], float]:
        opened: list[dict[str, Any]] = [{} for _ in range(20)]
        before = [
            asyncio.create_task(stream_one(urls[n % 2], key, "sluice-slow", n, 40, opened[n]))
            for n in range(20)
        ]

        async def placed() -> bool:  # text flows once the victim has placed a request
            return any(o.get("text") for o in opened)

        await eventually(placed, 60, "a stream placed by the dispatcher to be killed")
        stack.halt(victim, kill=True)
        killed_at = time.monotonic()
        after = [
            asyncio.create_task(stream_one(urls[n % 2], key, "sluice-slow", n, 40)) for n in range(20, 40)
        ]
        return list(await asyncio.gather(*before, *after)), killed_at

    try:
        results, killed_at = asyncio.run(go())
    finally:
        stack.resume(victim)
    assert_exact(results, 40)
    open_at_kill = [r for r in results if r["started"] < killed_at < r["ended"]]
    sent_after = [r for r in results if r["started"] > killed_at]
    assert open_at_kill, "streams were open when the dispatcher died"
    assert len(sent_after) == 20
    ids = {_request_id(r) for r in results}
    on = asyncio.run(_partitions_of(endpoints.kafka_bootstrap, topic, ids))
    assert set(on.values()) == {partition[_request_id(probe)]}, (
        "every stream went through the victim's partition"
    )
    assert charged_today(endpoints, "survivor") == sum(r["usage"] for r in [probe, *results])


def test_failover_of_a_primary_under_open_streams(cluster_stack: Stack) -> None:
    """kill -9 of a primary that has a replica while streams run on every shard: the replica takes its
    slots, and every stream ends with exactly its answer, those on the lost primary's slots too (their
    ingress follows the slots to the replica and fills any gap from the replay log)."""
    stack, endpoints = cluster_stack
    assert stack.cluster is not None
    key = fresh_key(endpoints, "failover")
    victim = stack.cluster.primaries[1]

    async def go() -> tuple[list[dict[str, Any]], float]:
        opened: list[dict[str, Any]] = [{} for _ in range(30)]
        streams = []
        for n in range(30):
            url = stack.ingress_urls[n % 2]
            streams.append(asyncio.create_task(stream_one(url, key, "sluice-slow", n, 60, opened[n])))
            await asyncio.sleep(0.02)

        def shard(o: dict[str, Any]) -> int | None:  # the shard of a stream text is flowing on, or None
            if not o.get("text") or o.get("ended") is not None:
                return None
            slot = key_slot(Names().stream_channel(_request_id(o)).encode())
            return next(i for i, (first, last) in enumerate(slot_ranges(3)) if first <= slot <= last)

        async def flowing() -> bool:  # the kill comes while text flows on every shard, the victim's too
            return {shard(o) for o in opened} >= {0, 1, 2}

        await eventually(flowing, 60, "streams flowing on every shard")
        stack.halt(victim.name, kill=True)
        killed_at = time.monotonic()
        return list(await asyncio.wait_for(asyncio.gather(*streams), 90)), killed_at

    started = time.monotonic()
    try:
        results, killed_at = asyncio.run(go())
        print(f"failover: {len(results)} streams ended in {time.monotonic() - started:.1f} s")
        assert_exact(results, 60)
        first, last = slot_ranges(3)[1]
        moved = [
            r for r in results
            if first <= key_slot(Names().stream_channel(_request_id(r)).encode()) <= last
            and r["started"] < killed_at < r["ended"]
        ]  # fmt: skip
        assert moved, "streams on the failed primary's slots were open when it died"
        after = asyncio.run(stream_many(stack, key, "sluice-sim", 6, 12))
        assert_exact(after, 12)
        for url in stack.ingress_urls:  # each ingress let go of its connection to the lost primary
            assert httpx.get(url + "/healthz", timeout=5).json()["status"] == "ok", url
    finally:
        # Back, as a replica of the primary that took its slots: the cluster is whole for what follows.
        node = stack.resume(victim.name)
        port = int(node.argv[node.argv.index("--port") + 1])
        until(lambda: _node_joined(port), 60, f"{victim.name} back in the cluster")


def _node_joined(port: int) -> bool:
    client = sync_redis.Redis(port=port, socket_timeout=2)
    try:
        info: Any = client.cluster("INFO")  # parsed: a dict of the fields
        return bool(info.get("cluster_state") == "ok")
    except sync_redis.RedisError:
        return False
    finally:
        client.close()
