"""Bad configuration stops a service at start with a clear message, instead of a crash loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.launcher import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


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
