"""The kubernetes backend's requests, made by the official client, as an API server receives them.

No cluster can run here, so the server is a stand-in on loopback that records the requests and answers
the way the API server's scale and pod-status endpoints do; what is checked is what the backend asks for,
and that it never writes to a pod.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from kubernetes import client

from infra.launcher import free_port
from queue_schemas.messages import Heartbeat, WorkerState
from scaler.backends import DrainAsks
from scaler.kubernetes import KubernetesBackend
from scaler.policy import Verdict

pytestmark = pytest.mark.timeout(60)


@dataclass
class Cluster:
    url: str
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    replicas: int = 2
    ready: dict[str, bool] = field(default_factory=dict)


@pytest.fixture
def api() -> Iterator[Cluster]:
    port = free_port()
    cluster = Cluster(f"http://127.0.0.1:{port}")
    app = FastAPI()

    def scale_body(ns: str, name: str) -> dict[str, Any]:
        meta = {"name": name, "namespace": ns}
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": meta,
                "spec": {"replicas": cluster.replicas}}  # fmt: skip

    @app.get("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale")
    async def read_scale(ns: str, name: str) -> dict[str, Any]:
        cluster.calls.append(("read-scale", f"{ns}/{name}", {}))
        return scale_body(ns, name)

    @app.patch("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale")
    async def scale(ns: str, name: str, request: Request) -> dict[str, Any]:
        body = await request.json()
        cluster.calls.append(("scale", f"{ns}/{name}", body))
        cluster.replicas = body["spec"]["replicas"]
        return scale_body(ns, name)

    @app.get("/api/v1/namespaces/{ns}/pods/{name}/status")
    async def pod_status(ns: str, name: str) -> dict[str, Any]:
        cluster.calls.append(("pod-status", f"{ns}/{name}", {}))
        ready = "True" if cluster.ready.get(name, True) else "False"
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                "status": {"conditions": [{"type": "Ready", "status": ready}]}}  # fmt: skip

    @app.api_route("/{path:path}", methods=["PATCH", "PUT", "POST", "DELETE"])
    async def anything_else(path: str, request: Request) -> dict[str, Any]:
        cluster.calls.append((request.method, path, {}))
        return {}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield cluster
    server.should_exit = True
    thread.join(5)


def beat(worker: str, running: int, state: WorkerState = WorkerState.READY) -> Heartbeat:
    return Heartbeat(
        worker_id=worker, pool="llama", model="m", state=state, seq=1, sent_at=time.time(),
        ttl_ms=3000, kv_blocks_total=1, kv_blocks_free=1, block_size=16, running=running, waiting=0,
        inbox_pending=0, decode_tokens_per_s=0, started_at=0,
    )  # fmt: skip


def test_scale_up_then_drain_one_pod_without_writing_to_pods(api: Cluster) -> None:
    api_client = client.ApiClient(client.Configuration(host=api.url))
    backend = KubernetesBackend(client.AppsV1Api(api_client), client.CoreV1Api(api_client), "serving")
    abc, defg = "sluice-worker-llama-abc", "sluice-worker-llama-def"
    beats = [beat(abc, 5), beat(defg, 1)]

    assert backend.apply("llama", Verdict("up", 4, 4, 3.0, "ramp"), beats, False) == DrainAsks()
    assert api.calls == [("scale", "serving/sluice-worker-llama", {"spec": {"replicas": 4}})]
    assert backend.launching("llama", {hb.worker_id for hb in beats}) == 2

    # Down: the least busy pod is asked to drain (through Redis, by the scaler); nothing is scaled yet.
    api.calls.clear()
    down = Verdict("down", 4, 3, 0.0, "calm")
    assert backend.apply("llama", down, beats, False) == DrainAsks(drain=(defg,))
    assert api.calls == []
    # It drains, but the API server still reports it ready: wait (and keep the request alive).
    draining = [beat(abc, 5), beat(defg, 1, WorkerState.DRAINING)]
    assert backend.apply("llama", Verdict("hold", 3, 3, 0.0, "steady"), draining, False) == DrainAsks(
        drain=(defg,)
    )
    assert [c[0] for c in api.calls] == ["pod-status"]
    # Not ready now: one replica fewer, and the ReplicaSet removes the not-ready pod.
    api.calls.clear()
    api.ready[defg] = False
    backend.apply("llama", Verdict("hold", 3, 3, 0.0, "steady"), draining, False)
    assert [c[0] for c in api.calls] == ["pod-status", "read-scale", "scale"]
    assert api.calls[-1] == ("scale", "serving/sluice-worker-llama", {"spec": {"replicas": 3}})
    # While it finishes its drain, it is not asked again nor counted for another scale-down.
    api.calls.clear()
    assert backend.apply("llama", Verdict("hold", 3, 3, 0.0, "steady"), draining, False) == DrainAsks()
    assert api.calls == []
    assert not [c for c in api.calls if c[0] in ("PATCH", "PUT", "POST", "DELETE")], "no pod writes"
    api_client.close()


def test_scaling_up_withdraws_a_pending_drain(api: Cluster) -> None:
    api_client = client.ApiClient(client.Configuration(host=api.url))
    backend = KubernetesBackend(client.AppsV1Api(api_client), client.CoreV1Api(api_client), "serving")
    beats = [beat("sluice-worker-llama-abc", 0), beat("sluice-worker-llama-def", 2)]
    asked = backend.apply("llama", Verdict("down", 2, 1, 0.0, "calm"), beats, False)
    assert asked == DrainAsks(drain=("sluice-worker-llama-abc",))
    up = backend.apply("llama", Verdict("up", 3, 1, 5.0, "burst"), beats, False)
    assert up == DrainAsks(withdraw=("sluice-worker-llama-abc",))
    assert api.calls == [("scale", "serving/sluice-worker-llama", {"spec": {"replicas": 3}})]
    api_client.close()
