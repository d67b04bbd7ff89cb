"""The scaler as a process, on the real broker and Redis, with its Kubernetes backend pointed at a stand-in
API server that fails: the loop survives, /healthz says 503 while no round succeeds, and both recover."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from infra.launcher import free_port
from tests.conftest import Bus
from tests.integration.helpers import Services, create_topics

pytestmark = pytest.mark.timeout(120)

POOL_FILE = """
[[pools]]
name = "sim"
model = "sluice-sim"
[pools.scaling]
min_replicas = 1
max_replicas = 2
"""

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{url}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u, namespace: serving}}}}]
current-context: x
"""


class StandIn:
    """Answers the scale subresource with a server error while `failing` is set."""

    def __init__(self) -> None:
        self.failing = True
        self.calls = 0
        app = FastAPI()

        @app.patch("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale")
        async def scale(ns: str, name: str, request: Request) -> JSONResponse:
            self.calls += 1
            if self.failing:
                return JSONResponse({"kind": "Status", "code": 500, "message": "etcd unavailable"}, 500)
            body = await request.json()
            meta = {"name": name, "namespace": ns}
            return JSONResponse({"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": meta, **body})

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )


@pytest.fixture
def api() -> Iterator[StandIn]:
    stand_in = StandIn()
    thread = threading.Thread(target=stand_in.server.run, daemon=True)
    thread.start()
    while not stand_in.server.started:
        time.sleep(0.02)
    yield stand_in
    stand_in.server.should_exit = True
    thread.join(5)


def wait_health(url: str, status: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    seen = None
    while time.monotonic() < deadline:
        try:
            seen = httpx.get(url, timeout=5).status_code
        except httpx.TransportError:  # not listening yet
            seen = None
        if seen == status:
            return
        time.sleep(0.2)
    raise AssertionError(f"/healthz stayed {seen}, not {status}")


async def test_a_failing_cluster_api_does_not_end_the_scaling_loop(
    bus: Bus, tmp_path: Path, api: StandIn
) -> None:
    settings = bus.settings()
    await create_topics(settings, settings.names.requests_topic("sim"), settings.names.batch_topic("sim"))
    services = Services(settings, tmp_path, POOL_FILE)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(url=f"http://127.0.0.1:{api.port}"))
    port = free_port()
    services.env.update(
        SLUICE_BACKEND="kubernetes",
        KUBECONFIG=str(kubeconfig),
        SLUICE_TICK_S="0.2",
        SLUICE_HEALTH_STALE_S="2",
    )
    try:
        services.start("scaler", "scaler", "--port", str(port))
        scaler = services.procs["scaler"]
        health = f"http://127.0.0.1:{port}/healthz"
        await asyncio.to_thread(
            wait_health, health, 503, 40
        )  # rounds keep failing: the API refuses every scale
        calls_while_failing = api.calls
        assert calls_while_failing >= 2, "the loop kept trying after the first failure"
        assert scaler.alive
        api.failing = False
        await asyncio.to_thread(
            wait_health, health, 200, 40
        )  # the next successful round makes it healthy again
        assert scaler.alive
    finally:
        services.stop()
