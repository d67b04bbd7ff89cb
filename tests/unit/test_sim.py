"""The fleet simulator's engine model, its scaling baselines, and a small fleet run end to end."""

from __future__ import annotations

import functools
import math
import random

import pytest

from bench.sim.engine import Replica, Request, TimingModel, leading_cached
from bench.sim.fleet import FleetState, simulate
from bench.sim.metrics import summarize, violation_minutes
from bench.sim.routers import make_router
from bench.sim.scalers import KedaScaler, ReactiveScaler
from bench.sim.workloads import blocks_of, shared_prefix
from gpu_workers.prefix_cache import PrefixCache

MODEL = TimingModel(decode_base_s=0.01, decode_per_seq_s=0.001, prefill_per_token_s=0.0001, chunk_tokens=1000)


def request(rid: int, prefix: str, prompt_blocks: int, output: int, at: float = 0.0) -> Request:
    return Request(rid, at, blocks_of(prefix, 0, prompt_blocks), prompt_blocks * 16, output)


def run_alone(replica: Replica, r: Request) -> None:
    replica.place(r, r.arrival)
    while math.isnan(r.done):
        replica.process(replica.next_event())


def test_bisected_match_equals_the_linear_one_under_eviction() -> None:
    rng = random.Random(3)
    cache = PrefixCache(300)
    chains = [blocks_of(f"c{i}", 0, 120) for i in range(12)]
    checked = partial = 0
    for step in range(2000):
        base = rng.choice(chains)
        prompt = base[: rng.randint(1, len(base))] + blocks_of(f"own{step}", 0, rng.randint(0, 20))
        for probe in (prompt, rng.choice(chains)):
            expected = cache.match(probe)
            assert leading_cached(cache, probe) == expected
            checked += 1
            partial += 0 < expected < len(probe)
        cache.capacity = rng.randint(150, 400)  # the replica's free blocks move with its running work
        cache.insert(prompt)
    assert checked == 4000
    assert partial > 500  # most probes end inside a chain, where bisection could go wrong


def test_one_request_takes_its_prefill_steps_then_one_step_per_token() -> None:
    replica = Replica(0, MODEL)
    r = request(1, "a", 125, 11)  # 2,000 prompt tokens: two prefill chunks
    run_alone(replica, r)
    prefill_step = 0.01 + 0.0001 * 1000
    assert r.first_token == pytest.approx(2 * prefill_step)
    assert r.done == pytest.approx(2 * prefill_step + 10 * (0.01 + 0.001 * 1))
    assert replica.own_used == 0
    assert replica.free_blocks == MODEL.kv_blocks


def test_a_cached_prefix_is_not_prefilled_again() -> None:
    replica = Replica(0, MODEL)
    first, second = request(1, "a", 125, 2), request(2, "a", 125, 2, at=1.0)
    run_alone(replica, first)
    run_alone(replica, second)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 125 * 16
    assert second.first_token - second.arrival < (first.first_token - first.arrival) / 5


def test_requests_wait_for_kv_blocks() -> None:
    small = TimingModel(kv_blocks=200, chunk_tokens=4096)
    replica = Replica(0, small)
    big = [request(i, f"p{i}", 100, 50) for i in range(3)]  # 104 blocks each with their output
    for r in big:
        replica.place(r, 0.0)
    assert len(replica.prefilling) == 1
    assert len(replica.waiting) == 2
    while replica.in_system:
        replica.process(replica.next_event())
    assert all(r.done > 0 for r in big)
    assert big[0].done <= big[1].first_token


def test_keda_follows_lag_and_holds_its_scale_down_for_the_window() -> None:
    keda = KedaScaler(1, 20, lag_threshold=10)
    state = functools.partial(FleetState, arrived=0, ready=[], starting=0, draining=0, completed_recent={})
    assert keda.target(state(now=0.0, backlog=95)) == 10
    assert keda.target(state(now=30.0, backlog=0, starting=10)) == 10  # stabilised
    assert keda.target(state(now=400.0, backlog=0, starting=10)) == 1


def test_reactive_scales_with_requests_in_the_system() -> None:
    rule = ReactiveScaler(1, 20, concurrency=10, target=0.5)
    replicas = [Replica(i, MODEL) for i in range(2)]
    state = FleetState(0.0, 0, backlog=30, ready=replicas, starting=0, draining=0, completed_recent={})
    assert rule.target(state) == 6  # 30 in the system / (10 per replica x 0.5)


def test_a_small_shared_prefix_run_is_complete_and_prefix_aware_placement_hits_the_cache() -> None:
    """30 tenants' contexts need 3,750 blocks; one replica holds 2,000, the four together 8,000."""
    workload = shared_prefix(rate=20.0, tenants=30, context=2000, duration_s=60.0)
    model = TimingModel(kv_blocks=2000)
    results = {}
    for name in ("sluice", "random"):
        out = simulate(functools.partial(make_router, name, 3), model, workload.requests, 60.0, 4)
        assert out.unfinished == 0
        results[name] = summarize(out)
    assert results["sluice"].finished == results["random"].finished > 1000
    assert results["sluice"].hit_rate > results["random"].hit_rate + 0.2
    assert results["sluice"].ttft_p90 < results["random"].ttft_p90
    assert violation_minutes([], 60.0, 2.0, unfinished=1) == 1
