"""Every service against TLS-configured settings: the same code, only SLUICE_* settings changed.

The broker and Redis sit behind TLS proxies with a test CA; the broker advertises its proxy, so every
Kafka connection (bootstrap and partition leaders) and every Redis connection is TLS, verified against
the CA. A streamed request that crosses all of them shows each service started and talks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infra.devstack import DevStack, Endpoints
from tests.tls import TlsProxy, make_certificates

pytestmark = pytest.mark.timeout(240)

POOLS = """
[[pools]]
name = "sim"
model = "sluice-sim"
[pools.simulated]
ttft_ms = 5
token_ms = 2
# One worker, so the state file below is written by that worker alone.
[pools.scaling]
max_replicas = 1
"""


@pytest.fixture(scope="module")
def tls_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Endpoints, dict[str, TlsProxy], Path]]:
    workdir = tmp_path_factory.mktemp("tls-stack")
    certs = make_certificates(workdir)
    config = workdir / "pools.toml"
    config.write_text(POOLS)
    proxies: dict[str, TlsProxy] = {}

    def front(service: str, port: int) -> int:
        proxies[service] = TlsProxy(certs, port)
        return proxies[service].start()

    security = {
        "kafka_security_protocol": "SSL",
        "kafka_ssl_cafile": str(certs.ca),
        "redis_ssl_ca_certs": str(certs.ca),
    }
    stack = DevStack(
        workdir, config_path=config, front=front, security=security, redis_tls=True,
        extra_env={"SLUICE_KAFKA_FETCH_WAIT_MS": "20", "SLUICE_STATE_FILE": str(workdir / "worker-state")},
    )  # fmt: skip
    try:
        endpoints = stack.start()
        yield endpoints, proxies, workdir / "worker-state"
    finally:
        stack.stop()
        for proxy in proxies.values():
            proxy.stop()


def test_every_service_runs_over_tls_with_settings_only(
    tls_stack: tuple[Endpoints, dict[str, TlsProxy], Path],
) -> None:
    endpoints, proxies, state_file = tls_stack
    assert endpoints.kafka_bootstrap == f"127.0.0.1:{proxies['kafka'].port}"
    assert endpoints.redis_url.startswith("rediss://")

    client = openai.OpenAI(base_url=endpoints.url + "/v1", api_key=endpoints.api_key, max_retries=0)
    stream = client.chat.completions.create(
        model="sluice-sim",
        messages=[{"role": "user", "content": "over TLS"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text
    assert finishes == ["stop"] or finishes == ["length"]
    assert chunks[-1].usage is not None

    # The scaler read lag and heartbeats through the proxies too (its report follows within a few ticks).
    deadline = time.monotonic() + 30
    while True:
        pools = httpx.get(endpoints.scaler_url + "/api/dashboard", timeout=5).json()["pools"]
        if (pools and pools[0]["replicas"]["ready"] >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    (sim,) = pools
    assert sim["replicas"]["ready"] >= 1
    assert sim["workers"], "heartbeats reached the scaler"

    # The state a readiness probe reads (`grep -qx ready`), written by the one worker.
    assert state_file.read_text() == "ready\n"

    # ingress, dispatcher, scaler, worker and the stack itself: many TLS sessions on each proxy.
    assert proxies["kafka"].handshakes >= 4
    assert proxies["redis"].handshakes >= 4


def test_a_plain_client_is_refused_by_the_tls_endpoint(
    tls_stack: tuple[Endpoints, dict[str, TlsProxy], Path],
) -> None:
    import redis

    endpoints, _, _ = tls_stack
    plain = redis.Redis.from_url(endpoints.redis_url.replace("rediss://", "redis://"), socket_timeout=2)
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()
    plain.close()
