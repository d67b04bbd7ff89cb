"""A worker stopped while its engine is still starting, on the real broker and Redis: it does not wait for
the engine's start-up (minutes on a real model), and its process leaves with every process under it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gpu_workers.settings import WorkerSettings
from gpu_workers.simulated import SimulatedEngine
from gpu_workers.worker import Worker
from plumbing.clients import redis_client
from queue_schemas.config import SimulatedEngineConfig
from tests.conftest import Bus
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)


class LoadingEngine(SimulatedEngine):
    """The simulated engine, with a start-up that loads on a thread until `loaded` is set, as vLLM's does."""

    def __init__(self) -> None:
        super().__init__(SimulatedEngineConfig(), block_size=16)
        self.loaded = threading.Event()
        self.loading = asyncio.Event()

    async def start(self) -> None:
        self.loading.set()
        await asyncio.to_thread(self.loaded.wait)
        await super().start()


async def test_a_worker_stopped_while_its_engine_starts_stops_without_waiting_for_it(bus: Bus) -> None:
    settings = bus.settings(WorkerSettings, worker_id="w-starting")
    assert isinstance(settings, WorkerSettings)
    redis = redis_client(settings)
    engine = LoadingEngine()
    worker = Worker(settings, engine, redis, "sluice-sim", max_running=4)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(engine.loading.wait(), 10)
        stop.set()
        code = await asyncio.wait_for(running, 10)  # the engine is still loading
        assert not engine.loaded.is_set()
        assert code == 0
        assert worker.stopped_starting
        assert worker.ready_at is None, "never ready, so nothing was placed on it"
    finally:
        engine.loaded.set()
        await redis.aclose()


async def test_a_worker_whose_engine_started_is_not_marked_stopped_starting(bus: Bus) -> None:
    settings = bus.settings(WorkerSettings, worker_id="w-started", drain_grace_s=0.0)
    assert isinstance(settings, WorkerSettings)
    redis = redis_client(settings)
    engine = LoadingEngine()
    engine.loaded.set()
    worker = Worker(settings, engine, redis, "sluice-sim", max_running=4)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:

        async def ready() -> bool:
            return worker.ready_at is not None

        await eventually(ready, 10, "the worker is ready")
        stop.set()
        assert await asyncio.wait_for(running, 30) == 0
        assert not worker.stopped_starting
    finally:
        await redis.aclose()


def test_exit_now_leaves_a_blocked_thread_behind_and_kills_the_processes_under_it() -> None:
    script = textwrap.dedent(
        """
        import subprocess, sys, threading
        from gpu_workers.main import exit_now
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        threading.Thread(target=threading.Event().wait).start()  # never ends, not a daemon
        exit_now(0)
        """
    )
    # Without exit_now the thread would hold the process open and the run would time out.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the process under the worker outlived it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
