"""Bad configuration stops a service at start with a clear message, instead of a crash loop."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from infra.launcher import free_port
from plumbing.state import read_heartbeats
from queue_schemas.codec import decode
from queue_schemas.messages import Heartbeat, WorkerState
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(90)


def run(
    args: list[str], tmp: Path, pool_file: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    if pool_file is not None:
        (tmp / "pools.toml").write_text(pool_file)
        full_env["SLUICE_CONFIG"] = str(tmp / "pools.toml")
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args], env=full_env, capture_output=True, text=True, timeout=60
    )


def test_scaler_refuses_min_above_max(tmp_path: Path) -> None:
    pools = '[[pools]]\nname = "p"\nmodel = "m"\n[pools.scaling]\nmin_replicas = 3\nmax_replicas = 1\n'
    result = run(["scaler", "--port", str(free_port())], tmp_path, pools)
    assert result.returncode == 2
    assert "pool p: min_replicas (3) exceeds max_replicas (1)" in result.stderr


def test_scale_from_zero_must_be_asked_for(tmp_path: Path) -> None:
    pools = '[[pools]]\nname = "p"\nmodel = "m"\n[pools.scaling]\nmin_replicas = 0\n'
    result = run(["scaler", "--port", str(free_port())], tmp_path, pools)
    assert result.returncode == 2
    assert "scale_to_zero" in result.stderr


def test_dispatcher_refuses_an_unknown_pool(tmp_path: Path) -> None:
    result = run(["dispatcher", "--pool", "nope"], tmp_path)
    assert result.returncode == 1
    assert "no pool named 'nope'; configured: sim" in result.stderr


def test_dispatcher_gives_up_on_an_unreachable_broker(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    result = run(
        ["dispatcher", "--pool", "sim"],
        tmp_path,
        SLUICE_KAFKA_BOOTSTRAP=f"127.0.0.1:{port}",
        SLUICE_CONNECT_ATTEMPTS="2",
    )
    assert result.returncode == 1
    assert f"connecting to Kafka at 127.0.0.1:{port} failed 2 times" in result.stderr


def test_an_invalid_pool_file_is_named(tmp_path: Path) -> None:
    result = run(["dispatcher", "--pool", "sim"], tmp_path, "[[pools]]\nname = 'sim'\n")
    assert result.returncode == 1
    assert "sluice dispatcher:" in result.stderr
    assert "pools.toml" in result.stderr
    assert "model" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_worker_whose_model_is_missing_reports_failed_and_exits(tmp_path: Path, bus: Bus) -> None:
    pools = (
        '[[pools]]\nname = "llm"\nmodel = "m"\nengine = "vllm"\nblock_size = 128\n'
        f'tokenizer = "{tmp_path}"\n[pools.vllm]\nsource = "{tmp_path / "no-such-model"}"\n'
    )
    settings = bus.settings()
    result = run(
        ["worker", "--pool", "llm", "--worker-id", "w1"],
        tmp_path,
        pools,
        SLUICE_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        SLUICE_REDIS_URL=settings.redis_url,
        SLUICE_PREFIX=settings.prefix,
    )
    assert result.returncode == 1
    assert "no such model folder" in result.stdout + result.stderr, "the reason is logged"

    async def last_heartbeat() -> bytes | None:
        redis = aioredis.Redis.from_url(settings.redis_url)
        try:
            # The failed heartbeat outlives the process by its TTL, for ops to read.
            raw = await redis.get(settings.names.heartbeat("llm", "w1"))
            return raw.encode() if isinstance(raw, str) else raw
        finally:
            await redis.aclose()

    raw = asyncio.run(last_heartbeat())
    assert raw is not None
    hb = decode(Heartbeat, raw)
    assert hb.state is WorkerState.FAILED
    assert "no such model folder" in (hb.error or "")

    async def membership() -> tuple[list[Heartbeat], list[str]]:
        redis = aioredis.Redis.from_url(settings.redis_url)
        try:
            return await read_heartbeats(redis, settings.names, "llm")
        finally:
            await redis.aclose()

    beats, gone = asyncio.run(membership())
    assert [b.worker_id for b in beats] == ["w1"], "ops still see the failed worker"
    assert gone == ["w1"], "dispatchers take over what was placed on it at once"


def test_an_ingress_whose_port_is_taken_exits_at_once(tmp_path: Path, bus: Bus) -> None:
    settings = bus.settings()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(
            ["ingress", "--port", str(port)],
            tmp_path,
            SLUICE_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
            SLUICE_REDIS_URL=settings.redis_url,
            SLUICE_PREFIX=settings.prefix,
        )
    assert result.returncode == 1
    assert f"sluice ingress: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "loading tokenizers" not in result.stdout, "refused before the app is built"
