"""Chaos: under a steady load of streamed requests, each service is killed (-9) in turn and Redis is
restarted; on a second stack the broker is killed and restarted on its durable storage (Tansu's S3
engine against a loopback object store). The test restarts what it stopped, as a supervisor would.
Redis keeps an append-only file, so keys, teams and quotas outlive its restart.

For every request the ingress accepted (HTTP 200), the client must see exactly one terminal event: the
final chunk of a complete answer (its text as long as its usage says) or an error event, never both, never
two, never none. The one exception is killing the ingress itself: its open streams are cut, and the client
sees the connection drop. After each fault the services must find each other again by themselves; the
time from the fault until a request sent after it succeeds is the recovery time, printed and kept in
test-artifacts/chaos.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from infra.devstack import DevStack, Endpoints
from infra.keys import set_reply_prefixes
from infra.launcher import free_port, start_object_store
from queue_schemas.clients import redis_client
from queue_schemas.codec import encode
from queue_schemas.settings import BusSettings
from tests.chaos.load import Load, Outcome
from tests.integration.helpers import (
    chat,
    create_topics,
    make_request,
    produce,
    read_answers,
    register_signer,
    submission,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

ARTIFACTS = Path(os.environ.get("SLUICE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
RECOVERY_LIMIT_S = 60.0
SETTLE_S = 3.0

POOLS = """
[[pools]]
name = "sim"
model = "sluice-sim"
default_max_tokens = 200
[pools.simulated]
ttft_ms = 5
token_ms = 8
min_words = 8
max_words = 8
[pools.scaling]
min_replicas = 2
max_replicas = 2
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Endpoints]]:
    workdir = tmp_path_factory.mktemp("chaos")
    config = workdir / "pools.toml"
    config.write_text(POOLS)
    dev = DevStack(workdir, config_path=config, redis_persist=True)
    try:
        yield dev, dev.start()
    finally:
        dev.stop()


@pytest.fixture(scope="module")
def durable_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Endpoints]]:
    """The broker's log in an S3 bucket. Tansu lists a partition's objects on every fetch, so the
    dispatcher fetches every 100 ms here rather than every few milliseconds."""
    workdir = tmp_path_factory.mktemp("chaos-durable")
    config = workdir / "pools.toml"
    config.write_text(POOLS)
    port = free_port()
    store = start_object_store(port, workdir / "logs")
    try:
        s3 = {
            "AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": f"http://127.0.0.1:{port}", "AWS_ALLOW_HTTP": "true",
        }  # fmt: skip
        boto3.client(
            "s3", endpoint_url=s3["AWS_ENDPOINT"], region_name=s3["AWS_DEFAULT_REGION"],
            aws_access_key_id="chaos", aws_secret_access_key="chaos",
        ).create_bucket(Bucket="broker")  # fmt: skip
        dev = DevStack(
            workdir, config_path=config, redis_persist=True, broker_storage="s3://broker/", broker_env=s3,
            extra_env={"SLUICE_KAFKA_FETCH_WAIT_MS": "100"},
        )  # fmt: skip
        try:
            yield dev, dev.start()
        finally:
            dev.stop()
    finally:
        store.stop()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the scaler's local backend starts the workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def kill_a_worker(dev: DevStack) -> None:
    workers = children(dev.process("scaler").popen.pid)
    assert workers, "the scaler's workers are running"
    os.kill(workers[0], signal.SIGKILL)


def recovered_at(outcomes: list[Outcome], since: float) -> float | None:
    """When the first request sent after `since` ended with a complete answer."""
    ends = [o.ended for o in outcomes if o.started > since and o.kind == "ok"]
    return min(ends) if ends else None


def exercise(
    dev: DevStack, endpoints: Endpoints, faults: list[tuple[str, Callable[[], object]]], clients: int
) -> tuple[dict[str, dict[str, object]], dict[str, float], list[Outcome]]:
    """Run the load through each fault in turn: (report per fault, when each struck, every outcome)."""
    load = Load(endpoints.url, endpoints.api_key, "sluice-sim", clients=clients)
    load.start()
    report: dict[str, dict[str, object]] = {}
    struck: dict[str, float] = {}
    try:
        time.sleep(SETTLE_S)
        assert recovered_at(load.outcomes(), 0.0) is not None, "the load runs before any fault"
        for name, inject in faults:
            at = struck[name] = time.time()
            inject()
            deadline = at + RECOVERY_LIMIT_S
            while (back := recovered_at(load.outcomes(), at)) is None and time.time() < deadline:
                time.sleep(0.1)
            assert back is not None, (
                f"no request succeeded within {RECOVERY_LIMIT_S:.0f} s of the {name} fault"
            )
            time.sleep(SETTLE_S)
            now = time.time()
            seen = load.outcomes()
            report[name] = {
                "recovery_s": round(back - at, 2),
                "in_flight": Load.tally([o for o in seen if o.started < at <= o.ended]),
                "sent_after": Load.tally([o for o in seen if at <= o.started < now]),
                "errors": sorted({o.detail for o in seen if o.kind == "error" and o.ended >= at}),
            }
    finally:
        outcomes = load.stop()
    return report, struck, outcomes


def keep(name: str, report: dict[str, dict[str, object]], outcomes: list[Outcome]) -> None:
    """Print the figures and keep them in test-artifacts/NAME.json."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    body = {"faults": report, "all": Load.tally(outcomes)}
    (ARTIFACTS / f"{name}.json").write_text(json.dumps(body, indent=2))
    print("\nfault       recovery s  requests in flight at the fault / sent after it, by ending")
    for fault, row in report.items():
        print(
            f"{fault:<11} {row['recovery_s']:>10}  {row['in_flight']} / {row['sent_after']}  {row['errors']}"
        )


def assert_all_running(dev: DevStack) -> None:
    """No service died of another's fault (the test restarts only what it killed)."""
    dead = [f"{p.name}:\n{p.log_tail(40)}" for p in dev.processes if not p.alive]
    assert not dead, "\n".join(dead)


def assert_each_ended_once(outcomes: list[Outcome], cut_at: float | None = None) -> None:
    broken = [o for o in outcomes if o.kind in ("hung", "bad")]
    assert not broken, f"requests without exactly one terminal event: {broken[:5]}"
    refused = [o.detail for o in outcomes if o.kind == "refused"]
    assert all(d.startswith(("503", "429")) for d in refused), f"refused other than 503/429: {refused[:5]}"
    # Only a dead ingress cuts streams: the ones open when it died.
    cut = [o for o in outcomes if o.kind == "cut"]
    if cut_at is None:
        assert not cut, cut[:5]
    else:
        assert all(o.started <= cut_at <= o.ended <= cut_at + 5 for o in cut), cut[:5]


def test_every_accepted_request_ends_once_through_every_service_fault(
    stack: tuple[DevStack, Endpoints],
) -> None:
    dev, endpoints = stack
    faults: list[tuple[str, Callable[[], object]]] = [
        ("worker", lambda: kill_a_worker(dev)),
        ("dispatcher", lambda: dev.restart("dispatcher-sim")),
        ("ingress", lambda: dev.restart("ingress")),
        ("scaler", lambda: dev.restart("scaler")),
        ("redis", lambda: dev.restart("redis", kill=False, down_s=1.0)),
    ]
    report, struck, outcomes = exercise(dev, endpoints, faults, clients=6)
    keep("chaos", report, outcomes)
    assert_each_ended_once(outcomes, cut_at=struck["ingress"])
    assert sum(1 for o in outcomes if o.kind == "ok") > 100, "the load kept flowing between the faults"


def test_every_accepted_request_ends_once_through_a_broker_restart(
    durable_stack: tuple[DevStack, Endpoints],
) -> None:
    dev, endpoints = durable_stack
    faults: list[tuple[str, Callable[[], object]]] = [("broker", lambda: dev.restart("broker", down_s=1.0))]
    report, _, outcomes = exercise(dev, endpoints, faults, clients=3)
    keep("chaos-broker", report, outcomes)
    assert_each_ended_once(outcomes)


def test_records_written_while_redis_is_down_are_served_when_it_returns(
    stack: tuple[DevStack, Endpoints],
) -> None:
    """Batch submitters and the ingress's last produces can put records on Kafka while Redis is down: the
    dispatcher keeps them (placement paused, batch admission deferred) and serves them once it is back."""
    dev, endpoints = stack
    bus = BusSettings(kafka_bootstrap=endpoints.kafka_bootstrap, redis_url=endpoints.redis_url)
    names = bus.names
    reply = f"answers.{names.prefix}.redis-down"
    interactive = make_request("sim", f"redis-down-{secrets.token_hex(6)}", max_tokens=5)
    custom_id = f"redis-down-{secrets.token_hex(6)}"
    batch = submission(custom_id, chat("while redis was down", max_tokens=5), team="dev", reply_topic=reply)

    async def signer() -> Ed25519PrivateKey:
        redis = redis_client(bus)
        try:
            await set_reply_prefixes(redis, names, "dev", [f"answers.{names.prefix}."])
            return await register_signer(redis, names, "dev")
        finally:
            await redis.aclose()

    async def produce_both(dev_signer: Ed25519PrivateKey) -> None:
        await create_topics(bus, reply, partitions=1)
        await produce(bus, [(names.requests_topic("sim"), encode(interactive))])
        await produce(bus, [(names.batch_topic("sim"), json.dumps(batch).encode())], dev_signer)

    dev_signer = asyncio.run(signer())
    dev.halt("redis", kill=False)
    try:
        asyncio.run(produce_both(dev_signer))
        time.sleep(2.0)  # the dispatcher meets the outage with both records in hand
        assert dev.process("dispatcher-sim").alive, dev.process("dispatcher-sim").log_tail(40)
    finally:
        dev.resume("redis")

    async def served() -> tuple[object, list[dict[str, Any]]]:
        answers = await read_answers(bus.kafka_bootstrap, reply, 1, 30)
        redis = redis_client(bus)
        try:
            return await redis.get(names.placement(interactive.request_id)), answers
        finally:
            await redis.aclose()

    placed_on, answers = asyncio.run(served())
    assert placed_on is not None, "the interactive request was placed once Redis was back"
    assert [a["custom_id"] for a in answers] == [custom_id]
    assert answers[0]["response"]["status_code"] == 200, answers[0]
    assert_all_running(dev)
