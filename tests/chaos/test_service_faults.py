"""Chaos: under a steady load of streamed requests, each service is killed (-9) in turn and Redis is
restarted; on a second stack the broker is killed and restarted on its durable storage (Tansu's S3
engine against a loopback object store). The test restarts what it stopped, as a supervisor would,
except a killed worker, which the scaler replaces. Redis keeps an append-only file, so keys, teams,
quotas and the streams' replay logs outlive its restart.

Worker, dispatcher, scaler and Redis faults must not show at all: every request accepted before, during
or after them ends with its complete answer, the very text an uninterrupted run gives (the simulated
engine's answer to its prompt), with one final chunk and usage. A request may be refused (503 while
Redis is away) but never accepted and then failed. Killing the ingress cuts its own open streams and
nothing else. After each fault every service must be running again; the recovery time runs to the
point where the system is whole again (the killed worker's replacement ready, the killed dispatcher's
partitions leased again, the restarted service answering), and is kept in test-artifacts/chaos.json with
the TTFT of requests that arrived during the fault.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import redis as sync_redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpu_workers.simulated import answer_to, apply_stops
from infra.devstack import DevStack, Endpoints
from infra.keys import set_reply_prefixes
from infra.launcher import ManagedProcess, free_port, start_object_store
from infra.usage_cli import read_usage
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from plumbing.clients import redis_client
from plumbing.processes import child_pids
from queue_schemas.codec import decode, encode
from queue_schemas.messages import Heartbeat
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

pytestmark = pytest.mark.timeout(600)

ARTIFACTS = Path(os.environ.get("SLUICE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
RECOVERY_LIMIT_S = 60.0
MIN_WORDS = 8
MAX_TOKENS = 200

# A fault: strike (given the running load), then return the check that says the stack is whole again.
Fault = Callable[[Load], Callable[[], bool]]

POOLS = f"""
[[pools]]
name = "sim"
model = "sluice-sim"
default_max_tokens = {MAX_TOKENS}
[pools.simulated]
ttft_ms = 5
token_ms = 8
min_words = {MIN_WORDS}
max_words = {MIN_WORDS}
[pools.scaling]
min_replicas = 2
max_replicas = 2
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Endpoints]]:
    workdir = tmp_path_factory.mktemp("chaos")
    config = workdir / "pools.toml"
    config.write_text(POOLS)
    # A relay's entries are taken over 5 s after it is killed (30 s by default), so usage is checked soon.
    dev = DevStack(
        workdir, config_path=config, redis_persist=True, extra_env={"SLUICE_USAGE_CLAIM_IDLE_S": "5"}
    )
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


def recovered_at(outcomes: list[Outcome], since: float) -> float | None:
    """When the first request sent after `since` ended with a complete answer."""
    ends = [o.ended for o in outcomes if o.started > since and o.kind == "ok"]
    return min(ends) if ends else None


class Probe:
    """What the test reads of the stack's state in Redis and over HTTP, to know when a fault is over."""

    def __init__(self, dev: DevStack, endpoints: Endpoints) -> None:
        self.last_problem: str | None = None
        self.dev = dev
        self.endpoints = endpoints
        self.names = BusSettings(
            kafka_bootstrap=endpoints.kafka_bootstrap, redis_url=endpoints.redis_url
        ).names

    def _redis(self) -> Any:
        return sync_redis.Redis.from_url(self.endpoints.redis_url, socket_timeout=1, socket_connect_timeout=1)

    def ready_workers(self) -> dict[str, float]:
        """Ready workers and when each one's process started."""
        client = self._redis()
        try:
            ids = sorted(m.decode() for m in client.smembers(self.names.workers("sim")))
            raws = client.mget([self.names.heartbeat("sim", w) for w in ids]) if ids else []
        finally:
            client.close()
        beats = [decode(Heartbeat, raw) for raw in raws if raw]
        return {hb.worker_id: hb.started_at for hb in beats if hb.state == "ready"}

    def lease_owners(self) -> list[str | None]:
        lease = self.names.partition_lease("sim")
        keys = [
            lease.format(topic=topic, partition=p)
            for topic in (self.names.requests_topic("sim"), self.names.batch_topic("sim"))
            for p in range(4)
        ]
        client = self._redis()
        try:
            return [o.decode() if o else None for o in client.mget(keys)]
        finally:
            client.close()

    def answers(self, url: str) -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def whole(self) -> bool:
        """Every process running, both workers ready, every partition leased to a live dispatcher."""
        self.last_problem = self.problem()
        return self.last_problem is None

    def problem(self) -> str | None:
        try:
            dead = [p.name for p in self.dev.processes if not p.alive]
            if dead:
                return f"not running: {dead}"
            ready = self.ready_workers()
            if len(ready) != 2:
                return f"ready workers: {sorted(ready)}"
            owners = self.lease_owners()
            if None in owners:
                return f"partitions not leased: {owners}"
            if not self.answers(self.endpoints.url):
                return "the ingress does not answer"
        except (sync_redis.RedisError, OSError) as exc:
            return f"redis: {exc}"
        return None


def kill_a_worker(dev: DevStack, probe: Probe) -> Callable[[], bool]:
    """Kill one of the scaler's workers; over when a new worker process is ready in its place."""
    workers = child_pids(dev.process("scaler").popen.pid)
    assert workers, "the scaler's workers are running"
    at = time.time()
    os.kill(workers[0], signal.SIGKILL)
    return lambda: probe.whole() and max(probe.ready_workers().values()) > at


def kill_a_dispatcher(dev: DevStack, probe: Probe) -> Callable[[], bool]:
    """Kill one of the pool's dispatchers and start it again; over when no partition is leased to it."""
    pid = dev.process("dispatcher-sim").popen.pid
    dev.restart("dispatcher-sim")
    dead = f"dispatcher-{pid}-"
    return lambda: probe.whole() and not any(o and o.startswith(dead) for o in probe.lease_owners())


def restart(dev: DevStack, probe: Probe, name: str, **how: Any) -> Callable[[], bool]:
    dev.restart(name, **how)
    return probe.whole


def broker_outage(dev: DevStack, probe: Probe, load: Load, down_s: float) -> Callable[[], bool]:
    """Kill the broker; send a request a second beside the load's clients while it is down (each of those
    is busy with an answer that may outlast the outage on a loaded machine), the last one well inside the
    ingress's produce timeout of the broker's return; start it again after `down_s`."""
    dev.halt("broker")
    until = time.monotonic() + down_s
    while (left := until - time.monotonic()) > 0:
        load.send(1)
        time.sleep(min(1.0, left))
    dev.resume("broker")
    return probe.whole


def exercise(
    probe: Probe,
    endpoints: Endpoints,
    faults: list[tuple[str, Fault]],
    clients: int,
    expected: Callable[[str], str] | None = None,
) -> tuple[dict[str, dict[str, object]], dict[str, float], list[Outcome]]:
    """Run the load through each fault in turn: (report per fault, when each struck, every outcome).

    A fault is over when its check says the stack is whole again, and then once `clients` requests sent
    after that have ended; the next fault follows."""
    load = Load(endpoints.url, endpoints.api_key, "sluice-sim", clients=clients, expected=expected)
    load.start()
    report: dict[str, dict[str, object]] = {}
    struck: dict[str, float] = {}
    try:
        wait_for(lambda: len([o for o in load.outcomes() if o.kind == "ok"]) >= 3 * clients, "the load runs")
        for name, inject in faults:
            at = struck[name] = time.time()
            over = inject(load)
            wait_for(over, f"the stack whole again after the {name} fault", lambda: probe.last_problem)
            whole = time.time()
            wait_for(
                lambda: sum(1 for o in load.outcomes() if o.started > whole) >= clients,  # noqa: B023
                f"requests sent after the {name} fault ended",
            )
            now = time.time()
            seen = load.outcomes()
            during = [o.ttft for o in seen if at <= o.started <= whole and o.ttft is not None]
            report[name] = {
                "recovery_s": round(whole - at, 2),
                "in_flight": Load.tally([o for o in seen if o.started < at <= o.ended]),
                "sent_after": Load.tally([o for o in seen if at <= o.started < now]),
                "errors": sorted({o.detail for o in seen if o.kind not in ("ok",) and o.ended >= at}),
                "ttft_p99_during_s": round(percentile(during, 99), 3) if during else None,
            }
    finally:
        outcomes = load.stop()
    # The baseline: requests sent after the first answer came back (the stack warmed) and before any fault.
    warm = min((o.ended for o in outcomes if o.kind == "ok"), default=0.0)
    first_fault = min(struck.values(), default=0.0)
    before = [o.ttft for o in outcomes if o.ttft is not None and warm <= o.started < first_fault]
    for row in report.values():
        row["ttft_p99_before_s"] = round(percentile(before, 99), 3) if before else None
    return report, struck, outcomes


def wait_for(condition: Callable[[], bool], what: str, why: Callable[[], object] = lambda: "") -> None:
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {RECOVERY_LIMIT_S:.0f} s: {what}; {why()}"
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def keep(name: str, report: dict[str, dict[str, object]], outcomes: list[Outcome]) -> None:
    """Print the figures and keep them in test-artifacts/NAME.json."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    body = {"faults": report, "all": Load.tally(outcomes)}
    (ARTIFACTS / f"{name}.json").write_text(json.dumps(body, indent=2))
    print(
        "\nfault       recovery s  TTFT p99 during (before)  in flight at the fault / sent after, by ending"
    )
    for fault, row in report.items():
        ttft = f"{row['ttft_p99_during_s']} ({row['ttft_p99_before_s']})"
        print(
            f"{fault:<11} {row['recovery_s']:>10}  {ttft:>24}  {row['in_flight']} / {row['sent_after']}"
            f"  {row['errors']}"
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


def consuming(proc: ManagedProcess) -> float:
    """How many partitions a dispatcher process consumes (its /metrics)."""
    port = (proc.env or {})["SLUICE_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    lines = [line for line in text.splitlines() if line.startswith("sluice_dispatcher_partitions{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def sim_answer(content: str) -> str:
    """What the chaos pool's simulated engine answers to one user message, uninterrupted."""
    prompt = ByteTokenizer().encode_chat([ChatMessage(role="user", content=content)])
    return apply_stops(answer_to(prompt, MIN_WORDS, MIN_WORDS), MAX_TOKENS, ())[0]


def test_no_accepted_request_fails_through_worker_dispatcher_scaler_and_redis_faults(
    stack: tuple[DevStack, Endpoints],
) -> None:
    dev, endpoints = stack
    probe = Probe(dev, endpoints)
    faults: list[tuple[str, Fault]] = [
        ("worker", lambda _: kill_a_worker(dev, probe)),
        ("dispatcher", lambda _: kill_a_dispatcher(dev, probe)),
        ("scaler", lambda _: restart(dev, probe, "scaler")),
        ("redis", lambda _: restart(dev, probe, "redis", kill=False, down_s=1.0)),
        ("ingress", lambda _: restart(dev, probe, "ingress")),
    ]
    report, struck, outcomes = exercise(probe, endpoints, faults, clients=6, expected=sim_answer)
    keep("chaos", report, outcomes)
    assert_all_running(dev)
    assert_each_ended_once(outcomes, cut_at=struck["ingress"])
    accepted_and_failed = [o for o in outcomes if o.kind not in ("ok", "refused", "unavailable", "cut")]
    assert not accepted_and_failed, accepted_and_failed[:5]
    # Up to the ingress kill, nothing accepted failed, whatever else was killed or restarted.
    ended_before = [o for o in outcomes if o.ended < struck["ingress"]]
    assert all(o.kind in ("ok", "refused") for o in ended_before), [
        o for o in ended_before if o.kind not in ("ok", "refused")
    ][:5]
    # The load kept flowing: after each fault struck, requests sent then were answered in full.
    for name, at in struck.items():
        assert any(o.kind == "ok" and o.started >= at for o in outcomes), f"no answer after the {name} fault"
    assert_one_usage_record_each(endpoints, outcomes, struck["ingress"])


def assert_one_usage_record_each(
    endpoints: Endpoints, outcomes: list[Outcome], ingress_killed: float
) -> None:
    """Every complete answer has its usage record with the usage its client saw, and one only: through
    the worker kill (the request moved) and the other faults. The relay runs in the ingress; killed,
    it may produce the entries it was sending again (docs/usage.md), so the ingress's own fault is left
    out of the count."""
    ok = [o for o in outcomes if o.kind == "ok"]
    settings = BusSettings(kafka_bootstrap=endpoints.kafka_bootstrap, redis_url=endpoints.redis_url)
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    while True:
        events = asyncio.run(read_usage(settings))
        by_id = {e.request_id: e for e in events}
        missing = [o.request_id for o in ok if o.request_id not in by_id]
        if not missing:
            break
        assert time.monotonic() < deadline, f"{len(missing)} complete answers without a usage record"
        time.sleep(1.0)
    counts = collections.Counter(e.request_id for e in events)
    assert [o.request_id for o in ok if o.ended < ingress_killed - 5 and counts[o.request_id] != 1] == []
    for o in ok:
        event = by_id[o.request_id]
        assert (event.team, event.status, event.completion_tokens) == (
            "dev",
            "completed",
            o.completion_tokens,
        )
        assert event.charged_tokens == event.prompt_tokens + event.completion_tokens


def test_every_accepted_request_ends_once_through_a_broker_restart(
    durable_stack: tuple[DevStack, Endpoints],
) -> None:
    dev, endpoints = durable_stack
    probe = Probe(dev, endpoints)
    down_s = 4.0
    faults: list[tuple[str, Fault]] = [("broker", lambda load: broker_outage(dev, probe, load, down_s))]
    report, struck, outcomes = exercise(probe, endpoints, faults, clients=6, expected=sim_answer)
    keep("chaos-broker", report, outcomes)
    assert_each_ended_once(outcomes)
    at = struck["broker"]
    in_flight = [o for o in outcomes if o.started < at <= o.ended]
    sent_while_down = [o for o in outcomes if at <= o.started <= at + down_s]
    assert in_flight, "requests were in flight when the broker went down"
    assert sent_while_down, "requests were sent while the broker was down"
    # Streams already placed go on over Redis, and records the broker had taken are on its durable log:
    # every request in flight is answered in full, with the exact answer.
    assert [o for o in in_flight if o.kind != "ok"] == []
    # Sent while it was down: answered once it is back, or refused before being accepted; never
    # accepted and then failed.
    assert [o for o in outcomes if o.kind not in ("ok", "refused", "unavailable")] == []
    assert any(o.kind == "ok" for o in sent_while_down), "one sent while the broker was down is answered"


def test_records_written_while_redis_is_down_are_served_when_it_returns(
    stack: tuple[DevStack, Endpoints],
) -> None:
    """Batch submitters and the ingress's last produces can put records on Kafka while Redis is down.
    The dispatchers cannot renew their partition leases then, so they stop consuming (before another
    could take the partitions); the records wait in Kafka and are served once Redis is back."""
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
    dispatchers = [p for p in dev.processes if p.name.startswith("dispatcher-sim")]
    dev.halt("redis", kill=False)
    try:
        wait_for(lambda: all(consuming(p) == 0 for p in dispatchers), "the dispatchers stop consuming")
        asyncio.run(produce_both(dev_signer))
        assert all(p.alive for p in dispatchers), [p.log_tail(40) for p in dispatchers]
    finally:
        dev.resume("redis")

    async def served() -> tuple[object, list[dict[str, Any]]]:
        answers = await read_answers(bus.kafka_bootstrap, reply, 1, 30)
        redis = redis_client(bus)
        try:  # the interactive record is on its own topic, leased apart from the batch one: wait for it too
            deadline = time.monotonic() + 30
            while (placed := await redis.get(names.placement(interactive.request_id))) is None:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            return placed, answers
        finally:
            await redis.aclose()

    placed_on, answers = asyncio.run(served())
    assert placed_on is not None, "the interactive request was placed once Redis was back"
    assert [a["custom_id"] for a in answers] == [custom_id]
    assert answers[0]["response"]["status_code"] == 200, answers[0]
    assert_all_running(dev)
