"""The kubernetes backend's requests, made by the official client, as an API server receives them.

No cluster can run here, so the server is a stand-in on loopback that records the requests and answers
the way the API server's scale and pod endpoints do; what is checked is what the backend asks for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from kubernetes import client

from infra.launcher import free_port
from queue_schemas.messages import Heartbeat, WorkerState
from scaler.backends import DELETION_COST, DRAINING_LABEL, KubernetesBackend
from scaler.policy import Verdict

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def api() -> Iterator[tuple[str, list[tuple[str, str, dict[str, Any]]]]]:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    app = FastAPI()

    @app.patch("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale")
    async def scale(ns: str, name: str, request: Request) -> dict[str, Any]:
        body = await request.json()
        calls.append(("scale", f"{ns}/{name}", body))
        meta = {"name": name, "namespace": ns}
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": meta, "spec": body["spec"]}

    @app.patch("/api/v1/namespaces/{ns}/pods/{name}")
    async def pod(ns: str, name: str, request: Request) -> dict[str, Any]:
        body = await request.json()
        calls.append(("pod", f"{ns}/{name}", body))
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, **body["metadata"]},
        }

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", calls
    server.should_exit = True
    thread.join(5)


def beat(worker: str, running: int) -> Heartbeat:
    return Heartbeat(
        worker_id=worker, pool="llama", model="m", state=WorkerState.READY, seq=1, sent_at=time.time(),
        ttl_ms=3000, kv_blocks_total=1, kv_blocks_free=1, block_size=16, running=running, waiting=0,
        inbox_pending=0, decode_tokens_per_s=0, started_at=0,
    )  # fmt: skip


def test_scale_up_and_drain_one_pod(api: tuple[str, list[tuple[str, str, dict[str, Any]]]]) -> None:
    url, calls = api
    configuration = client.Configuration(host=url)
    api_client = client.ApiClient(configuration)
    backend = KubernetesBackend(client.AppsV1Api(api_client), client.CoreV1Api(api_client), "serving")
    beats = [beat("sluice-worker-llama-abc", 5), beat("sluice-worker-llama-def", 1)]

    backend.apply("llama", Verdict("up", 4, 4, 3.0, "ramp"), beats, spec_decoding=False)
    assert calls == [("scale", "serving/sluice-worker-llama", {"spec": {"replicas": 4}})]
    assert backend.launching("llama", {hb.worker_id for hb in beats}) == 2

    backend.apply("llama", Verdict("down", 3, 2, 0.0, "calm"), beats, spec_decoding=False)
    kind, target, body = calls[1]
    assert (kind, target) == ("pod", "serving/sluice-worker-llama-def"), "the least busy pod drains"
    assert body["metadata"]["labels"] == {DRAINING_LABEL: "true"}
    assert body["metadata"]["annotations"] == {DELETION_COST: "-1000"}
    assert calls[2] == ("scale", "serving/sluice-worker-llama", {"spec": {"replicas": 3}})

    backend.apply("llama", Verdict("hold", 3, 3, 0.0, "steady"), beats, spec_decoding=False)
    assert len(calls) == 3
    api_client.close()
