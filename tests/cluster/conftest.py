"""The dev stack on a local Redis Cluster (three primaries, each with a replica), with two ingress
processes and two dispatchers per pool."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from infra.devstack import DevStack, Endpoints
from plumbing.clients import redis_client
from queue_schemas.settings import BusSettings

T = TypeVar("T")

POOLS = """
[[pools]]
name = "sim"
model = "sluice-sim"
engine = "simulated"
tokenizer = "bytes"
partitions = 4
[pools.simulated]
ttft_ms = 20
token_ms = 4
max_running = 64
[pools.scaling]
min_replicas = 2
max_replicas = 2

[[pools]]
name = "slow"            # streams long enough to kill something under them
model = "sluice-slow"
engine = "simulated"
tokenizer = "bytes"
default_max_tokens = 120
partitions = 4
[pools.simulated]
ttft_ms = 50
token_ms = 25
max_running = 64
[pools.scaling]
min_replicas = 2
max_replicas = 2
"""

FAST_STATE = {
    "SLUICE_KEEPALIVE_S": "0.2",
    "SLUICE_HEARTBEAT_INTERVAL_S": "0.2",
    "SLUICE_TICK_S": "0.5",
}


# Module scope: the stack's dozen processes are stopped before the tiers that follow start theirs.
@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Endpoints]]:
    workdir = tmp_path_factory.mktemp("cluster-stack")
    config = workdir / "pools.toml"
    config.write_text(POOLS)
    stack = DevStack(
        workdir, config_path=config, extra_env=FAST_STATE, redis_cluster=3, ingresses=2, dispatchers=2
    )
    endpoints = stack.start()
    try:
        yield stack, endpoints
    finally:
        stack.stop()


def bus_settings(endpoints: Endpoints, config: Path | None = None) -> BusSettings:
    return BusSettings(
        kafka_bootstrap=endpoints.kafka_bootstrap,
        redis_url=endpoints.redis_url,
        redis_cluster=True,
        config=config,
    )


def with_cluster(endpoints: Endpoints, action: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    """Run `action` with a cluster client of the stack's Redis."""

    async def go() -> T:
        redis = redis_client(bus_settings(endpoints))
        try:
            return await action(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())
