"""Liveness of background loops, /healthz bodies, and the small server that serves them beside /metrics."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from gpu_workers.presence import STALE_FLOOR_S, stale_after_s
from ingress.pubsub_replies import channel_of
from ingress.streams import reader_name
from plumbing.health import Liveness, health_body, item_failed, loop_state, serve_metrics_and_health
from queue_schemas.names import Names
from scaler.service import LagReader, Scaler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def failed_count(loop: str) -> float:
    return REGISTRY.get_sample_value("sluice_items_failed_total", {"loop": loop}) or 0.0


def test_a_loop_is_dead_once_its_task_ended_and_stuck_once_it_missed_its_rounds() -> None:
    assert loop_state(task_done=False, since_beat_s=5.0, stale_after_s=None) == "ok"
    assert loop_state(task_done=False, since_beat_s=5.0, stale_after_s=5.0) == "ok"
    assert loop_state(task_done=False, since_beat_s=5.1, stale_after_s=5.0) == "stuck"
    assert loop_state(task_done=True, since_beat_s=0.0, stale_after_s=5.0) == "dead"


async def test_liveness_reports_each_loop_from_its_task_and_its_beats() -> None:
    clock = Clock()
    liveness = Liveness(clock)
    forever = asyncio.create_task(asyncio.Event().wait())
    ended = asyncio.create_task(asyncio.sleep(0))
    await ended
    liveness.watch("steady", forever, stale_after_s=10.0)
    liveness.watch("no-rhythm", forever)
    assert liveness.report() == (True, {"steady": "ok", "no-rhythm": "ok"})

    clock.now += 11.0  # "steady" missed its rounds; a loop without a rhythm cannot be stuck
    assert liveness.report() == (False, {"steady": "stuck", "no-rhythm": "ok"})
    liveness.beat("steady")
    liveness.beat("never-watched")  # a beat of a loop nobody watches is ignored
    assert liveness.report() == (True, {"steady": "ok", "no-rhythm": "ok"})

    liveness.watch("ended", ended)
    assert liveness.report() == (False, {"steady": "ok", "no-rhythm": "ok", "ended": "dead"})
    liveness.forget("ended")  # a loop stopped on purpose is no longer reported
    assert liveness.report()[0]
    forever.cancel()
    assert liveness.report() == (True, {"steady": "ok", "no-rhythm": "ok"})  # cancel lands at the next step
    with pytest.raises(asyncio.CancelledError):
        await forever
    assert liveness.report() == (False, {"steady": "dead", "no-rhythm": "dead"})


def test_health_body_is_ok_only_while_every_loop_and_check_is() -> None:
    clock = Clock()
    liveness = Liveness(clock)
    assert health_body(liveness) == (200, {"status": "ok", "loops": {}})
    liveness.watch("relay", stale_after_s=1.0)
    assert health_body(liveness, extra=[("redis_streams", True)]) == (
        200,
        {"status": "ok", "loops": {"relay": "ok"}, "checks": {"redis_streams": "ok"}},
    )
    assert health_body(liveness, extra=[("redis_streams", False)]) == (
        503,
        {"status": "degraded", "loops": {"relay": "ok"}, "checks": {"redis_streams": "failing"}},
    )
    clock.now += 2.0
    assert health_body(liveness, extra=[("redis_streams", True)])[0] == 503


def test_item_failed_counts_per_loop() -> None:
    before = failed_count("test.unit")
    item_failed("test.unit")
    item_failed("test.unit")
    assert failed_count("test.unit") == before + 2


@pytest.fixture
def served() -> Iterator[tuple[str, Clock, Liveness]]:
    clock = Clock()
    liveness = Liveness(clock)
    server = serve_metrics_and_health(0, "127.0.0.1", liveness)
    try:
        yield f"http://127.0.0.1:{server.server_port}", clock, liveness
    finally:
        server.shutdown()
        server.server_close()


def test_the_server_answers_healthz_from_liveness_and_metrics_from_the_registry(
    served: tuple[str, Clock, Liveness],
) -> None:
    url, clock, liveness = served
    liveness.watch("heartbeat", stale_after_s=3.0)
    ok = httpx.get(url + "/healthz", timeout=5)
    assert ok.status_code == 200
    assert ok.headers["content-type"] == "application/json"
    assert ok.json() == {"status": "ok", "loops": {"heartbeat": "ok"}}

    clock.now += 4.0
    stuck = httpx.get(url + "/healthz", timeout=5)
    assert stuck.status_code == 503
    assert stuck.json() == {"status": "degraded", "loops": {"heartbeat": "stuck"}}

    item_failed("test.served")
    metrics = httpx.get(url + "/metrics", timeout=5)
    assert metrics.status_code == 200
    assert 'sluice_items_failed_total{loop="test.served"}' in metrics.text


def test_the_server_binds_an_ipv6_host() -> None:
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 here")
    server = serve_metrics_and_health(0, "::1", Liveness())
    try:
        assert httpx.get(f"http://[::1]:{server.server_port}/healthz", timeout=5).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_loop_is_stuck_after_a_few_missed_rounds_and_never_sooner_than_the_floor() -> None:
    assert stale_after_s(5.0) == 25.0
    assert stale_after_s(0.05) == STALE_FLOOR_S


def test_the_hub_names_its_readers_and_reads_a_channel_only_from_a_well_formed_message() -> None:
    assert reader_name("single") == "stream-hub-single"
    assert channel_of([b"message", b"c", b"x"]) == b"c"
    assert channel_of([b"message"]) is None
    assert channel_of([b"message", 7]) is None
    assert channel_of([b"pong", b""]) is None
    assert channel_of(None) is None


async def test_the_scaler_is_unhealthy_while_its_task_is_dead_or_no_round_succeeded_lately() -> None:
    none: Any = None
    scaler = Scaler(LagReader(none, none, Names()), none, none, {}, tick_s=1.0)
    liveness = Liveness(Clock())
    scaler.last_round_ok = 50.0
    assert scaler.health(liveness, stale_s=60.0, now=100.0) == (
        200,
        {"status": "ok", "loops": {}, "checks": {"scaling_rounds": "ok"}},
    )
    code, body = scaler.health(liveness, stale_s=30.0, now=100.0)
    assert (code, body["checks"]) == (503, {"scaling_rounds": "failing"})
    assert body["detail"] == "no scaling round succeeded lately"

    ended = asyncio.create_task(asyncio.sleep(0))
    await ended
    liveness.watch("scaler", ended)  # rounds succeeded lately, but the loop's task is gone
    code, body = scaler.health(liveness, stale_s=60.0, now=100.0)
    assert (code, body["loops"], body["checks"]) == (503, {"scaler": "dead"}, {"scaling_rounds": "ok"})
    assert "detail" not in body
