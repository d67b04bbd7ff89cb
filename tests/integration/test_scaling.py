"""The scaler on the real broker and Redis with its local backend and simulated workers.

A burst builds a backlog -> the scaler starts a second worker, which becomes ready -> the backlog drains
-> after the cooldown the scaler drains one worker, which finishes its requests and exits. Nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from infra.launcher import free_port
from plumbing.clients import redis_client
from queue_schemas.messages import FinalChunk, TokenChunk
from tests.conftest import Bus
from tests.integration.helpers import Services, collect, create_topics, make_request, send_requests, terminals

pytestmark = pytest.mark.timeout(150)

TOKENS = 80  # 2 s a request at 25 ms a token

POOL_FILE = """
[[pools]]
name = "sim"
model = "sluice-sim"
partitions = 2
[pools.simulated]
ttft_ms = 5
token_ms = 25
max_running = 2
[pools.scaling]
min_replicas = 1
max_replicas = 2
requests_per_replica_s = 1.0
startup_s = 2
queue_slo_s = 5
cooldown_s = 4
step_down_every_s = 1
"""


async def pools(url: str) -> dict[str, object]:
    """The scaler's report of the pool, or {} while the scaler is still starting."""
    try:
        async with httpx.AsyncClient() as client:
            body = (await client.get(url + "/api/pools")).json()
    except httpx.TransportError:
        return {}
    return next((p for p in body["pools"] if p["pool"] == "sim"), {})


async def wait_for(predicate_url: str, check: object, within_s: float) -> dict[str, object]:
    deadline = time.monotonic() + within_s
    report: dict[str, object] = {}
    while time.monotonic() < deadline:
        report = await pools(predicate_url)
        if report and check(report):  # type: ignore[operator]
            return report
        await asyncio.sleep(0.2)
    raise AssertionError(f"condition not met in {within_s} s; last report: {json.dumps(report)[:800]}")


async def test_burst_scales_up_drains_then_scales_down_by_draining(bus: Bus, tmp_path: Path) -> None:
    settings = bus.settings()
    names = settings.names
    await create_topics(settings, names.requests_topic("sim"), names.deadletter_topic(), partitions=2)
    services = Services(settings, tmp_path, POOL_FILE)
    services.env.update(SLUICE_BACKEND="local", SLUICE_WORKER_LOG_DIR=str(services.logs), SLUICE_TICK_S="0.3")
    # A worker queues at most two beyond what it runs, so the backlog waits in the dispatcher and Kafka
    # (where the scaler sees it) rather than in the first worker's inbox.
    services.env["SLUICE_MAX_QUEUE"] = "2"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    redis = redis_client(settings)
    try:
        services.start("dispatcher", "dispatcher", "--pool", "sim")
        services.start("scaler", "scaler", "--port", str(port))
        await wait_for(url, lambda r: r["replicas"]["ready"] == 1, within_s=60)

        # 24 s of work for one worker (two at a time, 2 s each): enough for a second one to start on a
        # loaded machine and take part.
        requests = [make_request("sim", f"req-burst-{i:05d}", max_tokens=TOKENS) for i in range(24)]
        ready = asyncio.Event()
        collector = asyncio.create_task(collect(redis, settings, {r.request_id for r in requests}, 90, ready))
        await ready.wait()
        await send_requests(settings, requests)

        scaled = await wait_for(url, lambda r: r["replicas"]["ready"] == 2, within_s=30)
        assert scaled["replicas"]["desired"] == 2  # type: ignore[index]
        events = await collector
        ends = {rid: terminals(evs) for rid, evs in events.items()}
        assert all(len(t) == 1 and isinstance(t[0], FinalChunk) for t in ends.values()), (
            "every request done once"
        )
        served_by = {t[0].worker_id for t in ends.values() if isinstance(t[0], FinalChunk)}
        assert served_by == {"sim-w0", "sim-w1"}, "the new worker took part of the backlog"
        for evs in events.values():  # nothing was cut short by the drain
            final = evs[-1]
            assert isinstance(final, FinalChunk)
            assert sum(e.num_tokens for e in evs if isinstance(e, TokenChunk | FinalChunk)) == TOKENS

        calm = await wait_for(
            url, lambda r: r["replicas"]["ready"] == 1 and r["replicas"]["draining"] == 0, 40
        )
        assert calm["status"] == "OK"
        async with httpx.AsyncClient(timeout=5) as client:
            board = (await client.get(url + "/api/dashboard")).json()
        (sim,) = [p for p in board["pools"] if p["pool"] == "sim"]
        (drained,) = served_by - {w["worker"] for w in sim["workers"]}  # the one the scaler sees no more
        assert await redis.get(names.heartbeat("sim", drained)) is None, "the drained worker left"
        assert not await redis.sismember(names.workers("sim"), drained)
    finally:
        services.stop()
        await redis.aclose()
