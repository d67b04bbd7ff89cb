"""`sluice dev` run as a user runs it, in a subprocess, for the e2e modules on real vLLM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from plumbing.processes import die_with_parent
from queue_schemas.codec import decode
from queue_schemas.messages import Heartbeat
from queue_schemas.names import Names


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but its exit status.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has name=value (the stack's children all carry its Redis URL)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


@dataclass
class DevRun:
    proc: subprocess.Popen[str]
    workdir: Path
    stderr_path: Path
    env: dict[str, str]
    pids: dict[str, int]
    curl_line: str


@contextmanager
def sluice_dev(tmp: Path, *options: str, env: dict[str, str] | None = None) -> Iterator[DevRun]:
    """`sluice dev` in a subprocess (with `env` added to this process's), up; stopped with Ctrl-C on the
    way out if it is still running."""
    workdir, stderr_path = tmp / "dev", tmp / "dev.stderr"
    argv = [sys.executable, "-m", "infra.cli", "dev", "--port", "0", "--workdir", str(workdir), *options]
    with (
        stderr_path.open("w") as stderr,
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with_parent,  # not left running by a test process that dies
        ) as proc,
    ):
        try:
            yield wait_for_stack(proc, workdir, stderr_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


async def pool_heartbeats(redis_url: str, pool: str) -> list[Heartbeat]:
    """The live heartbeats of a pool's workers."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in redis.scan_iter(match=Names().heartbeat(pool, "*"))]
        return [decode(Heartbeat, raw) for raw in await redis.mget(keys) if raw] if keys else []
    finally:
        await redis.aclose()


async def wait_ready(redis_url: str, wanted: dict[str, int]) -> None:
    """Until each pool has at least its number of ready workers (engines load for up to 10 minutes)."""
    for _ in range(1200):
        beats = {pool: await pool_heartbeats(redis_url, pool) for pool in wanted}
        if all(sum(hb.state == "ready" for hb in beats[pool]) >= n for pool, n in wanted.items()):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"workers did not become ready: {wanted}")


def wait_for_stack(proc: subprocess.Popen[str], workdir: Path, stderr_path: Path) -> DevRun:
    deadline = time.monotonic() + 420  # SmolLM2 is converted on the first run, then vLLM starts
    while not (workdir / "pids").exists():
        assert proc.poll() is None, stderr_path.read_text()
        assert time.monotonic() < deadline, "dev stack did not come up"
        time.sleep(0.2)
    pids = {line.split()[0]: int(line.split()[1]) for line in (workdir / "pids").read_text().splitlines()}
    env = dict(line.split("=", 1) for line in (workdir / "dev.env").read_text().splitlines())
    assert proc.stdout is not None
    curl_line = next(line for line in iter(proc.stdout.readline, "") if line.startswith("curl "))
    return DevRun(proc, workdir, stderr_path, env, pids, curl_line)
