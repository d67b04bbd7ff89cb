from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from infra.devstack import DevStack, Endpoints
from infra.keys import create_key, set_team_limits
from infra.models import build_tiny_tokenizer
from plumbing.protocol.quota import utc_day
from plumbing.replay import is_terminal, read_log
from queue_schemas.codec import decode
from queue_schemas.messages import Heartbeat, PoolState, StreamEvent
from queue_schemas.names import Names
from queue_schemas.teams import TeamLimits

# Pools beside the default one, each there for a behaviour the tests need to see.
EXTRA_POOLS = """
[[pools]]
name = "slow"            # long enough to disconnect from, queue behind, and see keep-alives
model = "sluice-slow"
default_max_tokens = 200
[pools.simulated]
ttft_ms = 400
token_ms = 40

[[pools]]
name = "flaky"           # fails mid-stream
model = "sluice-flaky"
[pools.simulated]
ttft_ms = 5
token_ms = 5
fail_after_tokens = 5

[[pools]]
name = "empty"           # configured but disabled: no worker will serve it
model = "sluice-empty"
[pools.scaling]
min_replicas = 0
max_replicas = 0

[[pools]]
name = "shared"          # teams reuse each other's cached prefixes (opted in)
model = "sluice-shared"
shared_prefix_cache = true
[pools.scaling]          # one worker: a repeat meets the cache its first request filled
min_replicas = 1
max_replicas = 1

[[pools]]
name = "private"         # the default, per-team prefixes, on one worker like `shared`
model = "sluice-private"
[pools.scaling]
min_replicas = 1
max_replicas = 1

[[pools]]
name = "tok"             # a real BPE tokenizer and chat template from a model folder
model = "sluice-tok"
tokenizer = "{tokenizer}"
"""

FAST_STATE = {
    "SLUICE_KEEPALIVE_S": "0.2",
    "SLUICE_HEARTBEAT_INTERVAL_S": "0.2",
    "SLUICE_TICK_S": "0.5",
    # Caps small enough for the hostile-neighbour test to reach (each test uses teams of its own).
    "SLUICE_FILES_PER_TEAM": "10",
    "SLUICE_BATCHES_PER_TEAM": "3",
    "SLUICE_CORS_ORIGINS": '["*"]',  # the EventSource test's page is on another origin
    "SLUICE_RESPONSES_CANCEL_WAIT_S": "15",  # time for the worker's report on a loaded machine
}


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("models") / "tiny-tokenizer")


@pytest.fixture(scope="package")
def dev_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path
) -> Iterator[tuple[DevStack, Endpoints]]:
    """The same embedded stack `make run` starts (broker, Redis, every service as processes), more pools,
    with one dispatcher per pool (two per pool are the cluster and chaos tiers' concern). It stops after
    the e2e tier's last test: an idle stack still polls the broker, and the tiers after it need the cores."""
    workdir = tmp_path_factory.mktemp("stack")
    default = (Path(__file__).parents[2] / "queue_schemas" / "default_pools.toml").read_text()
    config = workdir / "pools.toml"
    config.write_text(default + EXTRA_POOLS.format(tokenizer=tiny_tokenizer))
    stack = DevStack(workdir, config_path=config, extra_env=FAST_STATE, dispatchers=1, ingresses=2)
    endpoints = stack.start()
    try:
        yield stack, endpoints
    finally:
        stack.stop()


@pytest.fixture
def endpoints(dev_stack: tuple[DevStack, Endpoints]) -> Endpoints:
    return dev_stack[1]


def team_key(
    endpoints: Endpoints, team: str, limits: TeamLimits | None = None, *, allow_priority: bool = False
) -> str:
    """A fresh key for `team`, with the team's limits set first when given."""

    async def go() -> str:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            if limits is not None:
                await set_team_limits(redis, Names(), team, limits)
            return await create_key(redis, Names(), team, allow_priority=allow_priority)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def stored(endpoints: Endpoints, key: str) -> bytes | None:
    """The value the stack's Redis holds at `key`, or None."""

    async def go() -> bytes | None:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            raw = await redis.get(key)
            return raw if raw is None or isinstance(raw, bytes) else raw.encode()
        finally:
            await redis.aclose()

    return asyncio.run(go())


def day_used(endpoints: Endpoints, team: str) -> int:
    """Tokens charged to `team` today, after settlement."""
    return int(stored(endpoints, Names().quota_day(team, utc_day(time.time()))) or 0)


def running_on(endpoints: Endpoints, pool: str, worker_id: str) -> int:
    """The requests a worker's heartbeat says it runs; 0 once the worker is gone (the scaler drains idle
    workers, and a stopped worker's heartbeat lapses)."""
    raw = stored(endpoints, Names().heartbeat(pool, worker_id))
    return 0 if raw is None else decode(Heartbeat, raw).running


def pool_state(endpoints: Endpoints, pool: str) -> PoolState | None:
    """The state the scaler last published for `pool` (what the ingress's pool gate reads)."""
    raw = stored(endpoints, Names().pool_state(pool))
    return None if raw is None else decode(PoolState, raw)


def placed_on(endpoints: Endpoints, request_id: str) -> str:
    """The worker the request was placed on, from its placement record."""
    raw = stored(endpoints, Names().placement(request_id))
    assert raw is not None, f"{request_id} has no placement record"
    return raw.decode()


def terminal_log(endpoints: Endpoints, request_id: str) -> list[StreamEvent]:
    """The request's replay log once it holds the terminal chunk; empty until then."""

    async def go() -> list[StreamEvent]:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            return await read_log(redis, Names(), request_id)
        finally:
            await redis.aclose()

    log = asyncio.run(go())
    return log if log and is_terminal(log[-1]) else []


_open_clients: list[openai.OpenAI] = []


def openai_client(endpoints: Endpoints, key: str | None = None, **options: Any) -> openai.OpenAI:
    """The official client pointed at the stack; closed when the test ends."""
    options.setdefault("max_retries", 0)
    client = openai.OpenAI(base_url=endpoints.url + "/v1", api_key=key or endpoints.api_key, **options)
    _open_clients.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _open_clients:
        _open_clients.pop().close()


CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    assert not missing, f"{missing} not installed: `make test` installs Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--window-size=1280,1400", f"--user-data-dir={tmp_path / 'profile'}",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
