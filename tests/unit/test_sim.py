"""The fleet simulator: its engine model, its views, each baseline's published rule on small hand-made
states, and what sluice's own placement guarantees in a small fleet run."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import numpy as np
import pytest

from bench.sim.__main__ import Run, line_style, model_error_one, scaling_points
from bench.sim.disagg import SplitFleet, SplitResult, SplitRun, spread
from bench.sim.engine import Replica, Request, Seq, TimingModel, leading_cached
from bench.sim.fleet import Fleet, FleetState, SimHold, simulate
from bench.sim.metrics import Sketch, Stats, percentile, summarize, violation_minutes
from bench.sim.routers import (
    ROUTERS,
    DynamoRouter,
    LlmdPredictedLatencyRouter,
    LlmdRouter,
    SglangRouter,
    make_router,
)
from bench.sim.scalers import (
    ArimaPredictor,
    DynamoAggPlannerScaler,
    DynamoPlannerScaler,
    KedaScaler,
    LlmdWvaScaler,
    ReactiveScaler,
    WorkerLoad,
    agg_planner_step,
    sla_load,
    wva_decision,
)
from bench.sim.views import Snapshot
from bench.sim.workloads import blocks_of, shared_prefix
from gpu_workers.prefix_cache import PrefixCache

MODEL = TimingModel(decode_base_s=0.01, decode_per_seq_s=0.001, prefill_per_token_s=0.0001, chunk_tokens=1000)


def request(rid: int, prefix: str, prompt_blocks: int, output: int, at: float = 0.0) -> Request:
    return Request(rid, at, blocks_of(prefix, 0, prompt_blocks), prompt_blocks * 16, output)


def run_alone(replica: Replica, r: Request) -> None:
    replica.place(r, r.arrival)
    while math.isnan(r.done):
        replica.process(replica.next_event())


def _place_if_chosen(chosen: set[int], placed: list[int], q: Request) -> bool:
    if q.rid in chosen:
        placed.append(q.rid)
    return q.rid in chosen


@pytest.mark.parametrize("fair", [True, False])
def test_the_holds_running_prompt_tokens_and_oldest_arrival_equal_a_count_of_it(fair: bool) -> None:
    rng = random.Random(5)
    hold = SimHold(fair=fair)
    held: dict[int, Request] = {}
    assert hold.oldest_arrival() == math.inf
    rid = 0
    for _ in range(40):
        for _ in range(rng.randrange(0, 6)):
            rid += 1
            r = request(rid, f"t{rid % 4}", rng.randrange(1, 9), 5, at=rng.uniform(0, 100))
            r.priority = rng.choice(["interactive", "batch"])
            r.tenant = rid % 4
            hold.add(r)
            held[r.rid] = r
        chosen = {q.rid for q in held.values() if rng.random() < 0.3}
        placed: list[int] = []
        place = functools.partial(_place_if_chosen, chosen, placed)
        hold.retry(place, max_misses=rng.randrange(1, 5))  # stops after that many failures in a row
        for placed_rid in placed:
            del held[placed_rid]
        assert len(hold) == len(held)
        assert hold.prompt_tokens == sum(q.prompt_tokens for q in held.values())
        assert hold.oldest_arrival() == min((q.arrival for q in held.values()), default=math.inf)


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


def test_a_prompt_arriving_during_a_step_joins_the_next_one() -> None:
    replica = Replica(0, MODEL)
    running = request(1, "a", 1, 100)
    replica.place(running, 0.0)
    replica.process(replica.next_event())  # its one-block prompt is done; it decodes from here on
    step = 0.01 + 0.001 * 1
    boundary = running.first_token + 5 * step
    late = request(2, "b", 1, 2, at=boundary + 0.4 * step)  # 16 prompt tokens, mid-step
    replica.place(late, late.arrival)
    while math.isnan(late.done):
        replica.process(replica.next_event())
    # Not the end of the step in progress (boundary + 1 step), but of the one after it.
    assert late.first_token == pytest.approx(boundary + 2 * step, rel=0.05)


def test_requests_wait_for_their_prompts_blocks_and_the_latest_decoder_is_preempted_when_kv_is_full() -> None:
    small = TimingModel(kv_blocks=200, chunk_tokens=4096)
    replica = Replica(0, small)
    big = [request(i, f"p{i}", 100, 50) for i in range(3)]  # 100 prompt blocks each; 4 more to decode
    for r in big:
        replica.place(r, 0.0)
    assert len(replica.prefilling) == 2, "admitted on their prompts' blocks, not their outputs'"
    assert len(replica.waiting) == 1
    assert replica.free_blocks == 0
    drain(replica)
    assert all(r.done > 0 for r in big)
    # The first token of each needs a block that is not there: the later one goes back to wait.
    assert (big[0].preempted, big[1].preempted) == (0, 1)
    assert big[0].done <= big[2].first_token
    assert replica.free_blocks == 200


def batch(r: Request) -> Request:
    r.priority = "batch"
    return r


def drain(replica: Replica) -> None:
    while replica.in_system:
        replica.process(replica.next_event())


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_under_priority_an_interactive_prompt_is_prefilled_before_batch_prompts_queued_ahead(
    scheduling: str,
) -> None:
    replica = Replica(0, TimingModel(chunk_tokens=1000, scheduling=scheduling))
    batches = [batch(request(i, f"b{i}", 125, 2)) for i in range(4)]  # 2,000 tokens each: 2 steps
    for r in batches:
        replica.place(r, 0.0)
    urgent = request(9, "i", 10, 2, at=0.001)
    replica.place(urgent, urgent.arrival)
    drain(replica)
    ahead = sum(r.first_token < urgent.first_token for r in batches)
    # fcfs: behind all four (8 steps of prefill); priority: only behind the one whose prefill began.
    assert ahead == (4 if scheduling == "fcfs" else 1)


def test_an_interactive_request_short_of_blocks_preempts_the_latest_decoding_batch_request() -> None:
    model = TimingModel(kv_blocks=60, chunk_tokens=4096, scheduling="priority")
    replica = Replica(0, model)
    old, new = batch(request(1, "o", 20, 1600)), batch(request(2, "n", 20, 1600, at=0.001))
    replica.place(old, old.arrival)
    replica.place(new, new.arrival)
    while math.isnan(new.first_token):
        replica.process(replica.next_event())
    replica.advance(1.0)  # both decoding, each with about 5 blocks of output
    held = replica.used_blocks()
    assert 45 <= held < 60
    urgent = request(3, "i", 20, 1600, at=1.0)  # 20 blocks of prompt: fewer are free
    replica.place(urgent, 1.0)
    assert (old.preempted, new.preempted, replica.preemptions) == (0, 1, 1)
    assert len(replica.prefilling) == 1
    drain(replica)
    assert new.done > urgent.done  # it waited for blocks, then computed its prompt and output again
    assert replica.free_blocks == 60
    assert not replica.waiting
    assert replica.completed == 3


def test_fcfs_never_preempts_for_an_admission() -> None:
    replica = Replica(0, TimingModel(kv_blocks=300, chunk_tokens=4096))
    first = batch(request(1, "o", 20, 320))
    replica.place(first, 0.0)
    replica.advance(1.0)
    urgent = request(2, "i", 300, 2, at=1.0)  # more blocks than are free: it waits
    replica.place(urgent, 1.0)
    assert replica.preemptions == 0
    assert len(replica.waiting) == 1
    drain(replica)
    assert replica.preemptions == 0
    assert first.done <= urgent.first_token


def test_decoding_shrinks_the_prefix_cache_and_the_books_hold_through_growth_preemptions() -> None:
    model = TimingModel(kv_blocks=300, chunk_tokens=2048)
    replica = Replica(0, model)
    replica.cache.insert(blocks_of("old", 0, 250))  # a cache filling what sequences leave free
    rs = [request(i, f"q{i}", 10, 800 + 100 * i, at=0.001 * i) for i in range(8)]
    for r in rs:
        replica.place(r, r.arrival)
    while replica.in_system:
        replica.process(replica.next_event())
        admitted = [s for _, _, s in replica.running] + list(replica.prefilling)
        assert replica.own_used == sum(s.own_blocks for s in admitted)
        assert replica._growing == len(replica.running)
        assert len(replica.cache) <= max(1, model.kv_blocks - replica.used_blocks())
        assert replica.used_blocks() <= model.kv_blocks + 1
    assert replica.preemptions > 0, "decoding outgrew the KV"
    assert all(r.done > 0 for r in rs)
    assert replica.free_blocks == 300


def test_kv_usage_never_depends_on_the_hidden_output_lengths_of_running_requests() -> None:
    """Two replicas given the same prompts, whose outputs differ only in their (hidden) lengths, report
    the same figures until the first request ends."""
    model = TimingModel(kv_blocks=400, chunk_tokens=2048)
    short = Replica(0, model)
    long = Replica(1, model)
    arrivals = [(0.01 * i, f"t{i % 3}", 10 + 7 * i) for i in range(12)]
    shorts = [request(i, p, n, 300 + 40 * i, at=t) for i, (t, p, n) in enumerate(arrivals)]
    longs = [request(i, p, n, 3000 + 400 * i, at=t) for i, (t, p, n) in enumerate(arrivals)]
    for a, b in zip(shorts, longs, strict=True):
        short.place(a, a.arrival)
        long.place(b, b.arrival)

    def figures(r: Replica) -> tuple[float, ...]:
        return (r.free_blocks, r.queue, r.scheduled, r.in_system, r.prefill_tokens(), r.decode_blocks())

    first_end = 0.01 * 11 + 300 * model.decode_base_s  # before this, no short request can have ended
    compared = 0
    now = 0.11
    free_at_start = math.inf
    while now < first_end:
        for r in (short, long):
            while r.next_event() <= now:
                assert not r.process(r.next_event()), "a request ended before the comparison stops"
            r.advance(now)
        assert figures(short) == figures(long), now
        free_at_start = min(free_at_start, short.free_blocks) if compared < 5 else free_at_start
        compared += 1
        now += 0.05
    assert compared > 50
    assert short.free_blocks < free_at_start - 100, "the decoding sequences took blocks as they generated"


def adapted(r: Request, adapter: int) -> Request:
    r.adapter = adapter
    return r


def test_a_replica_loads_an_adapter_once_and_passes_over_a_third_while_two_run() -> None:
    model = TimingModel(chunk_tokens=1000, prefill_per_token_s=0.0001, max_loras=2, adapter_load_s=0.05)
    replica = Replica(0, model)
    a, b = adapted(request(1, "a", 10, 50), 0), adapted(request(2, "b", 10, 50), 1)
    c, a2 = adapted(request(3, "c", 10, 5), 2), adapted(request(4, "a2", 10, 5, at=0.001), 0)
    for r in (a, b, c, a2):
        replica.place(r, r.arrival)
    # a and b run; c's adapter would be a third: it waits, and a2 (adapter 0, held) is admitted past it.
    assert replica.active_adapters() == {0, 1}
    assert [s.request for s in replica.waiting] == [c]
    assert (a.adapter_loads, b.adapter_loads, a2.adapter_loads) == (1, 1, 0)
    drain(replica)
    assert a2.done < c.first_token  # c started only once an adapter's last request ended
    assert c.adapter_loads == 1
    assert replica.held_adapters() == {2, 0} or replica.held_adapters() == {2, 1}  # one evicted for c
    assert replica.adapter_loads == 3
    assert not replica.active_adapters()


def test_a_load_costs_prefill_time() -> None:
    model = TimingModel(chunk_tokens=1000, prefill_per_token_s=0.0001, max_loras=2, adapter_load_s=0.05)
    plain, loaded = Replica(0, model), Replica(1, model)
    base, adapted_one = request(1, "p", 10, 2), adapted(request(2, "p", 10, 2), 0)
    run_alone(plain, base)
    run_alone(loaded, adapted_one)
    # 500 tokens of prefill time more: at 1,000 tokens a step that is about one more step.
    assert adapted_one.first_token - base.first_token == pytest.approx(0.05, rel=0.2)


def test_llm_d_lora_affinity_scores_as_the_gateway_scorer_does() -> None:
    from bench.sim.routers import lora_affinity

    model = TimingModel(max_loras=2)
    replica = Replica(0, model)
    replica.active.update({0: 1})
    assert lora_affinity(replica, 0) == 1.0
    assert lora_affinity(replica, 5) == 0.8  # room for one more
    replica.active.update({1: 1})
    assert lora_affinity(replica, 5) == 0.0
    replica.waiting.append(Seq(adapted(request(9, "w", 1, 1), 5), 0))
    assert lora_affinity(replica, 5) == 0.6


def fleet_state(**kw: object) -> FleetState:
    base: dict[str, object] = dict(
        now=0.0, arrived=0, backlog=0, ready=[], starting=0, draining=0, completed_recent={}
    )
    base.update(kw)
    return FleetState(**base)  # type: ignore[arg-type]


def test_keda_asks_for_lag_over_threshold_and_holds_its_scale_down_for_the_window() -> None:
    keda = KedaScaler(1, 20, lag_threshold=10)
    assert keda.target(fleet_state(lag=95, backlog=95, starting=10)) == 10
    assert keda.target(fleet_state(now=30.0, starting=10)) == 10  # stabilised
    assert keda.target(fleet_state(now=400.0, starting=10)) == 1
    assert KedaScaler(1, 20, lag_threshold=50).target(fleet_state(lag=95, backlog=95, starting=2)) == 2


def test_keda_reads_the_consumer_groups_lag_not_requests_waiting_inside_engines() -> None:
    keda = KedaScaler(1, 20, lag_threshold=10)
    assert keda.target(fleet_state(lag=0, backlog=95, starting=1)) == 1


class FixedTarget:
    name = "fixed"
    interval_s = 15.0

    def __init__(self, target: int) -> None:
        self.wanted = target

    def target(self, state: FleetState) -> int:
        return self.wanted


def test_a_lower_target_drains_that_many_replicas_at_once() -> None:
    fleet = Fleet(make_router("round-robin", 1), MODEL, 6, scaler=FixedTarget(2))
    fleet.run(iter(()), until=1.0)
    assert len(fleet.live) == 2
    assert fleet.timeline[0][1] == 2


def test_a_lower_target_cancels_replicas_still_starting_before_it_drains_ready_ones() -> None:
    scaler = FixedTarget(5)
    fleet = Fleet(make_router("round-robin", 1), MODEL, 2, scaler=scaler, startup_s=100.0)
    arrivals = iter([request(i, f"p{i}", 4, 3000, at=float(i)) for i in range(40)])
    fleet.run(arrivals, until=5.0, drain_s=14.0)  # one tick at 0 s: 3 launched
    assert (fleet.starting, len(fleet.live)) == (3, 2)
    scaler.wanted = 3
    fleet._scale(15.0, fleet._by_index)
    assert (fleet.starting, len(fleet.live)) == (1, 2)  # two of the starting ones are cancelled
    assert not any(r.draining for r in fleet.live)
    scaler.wanted = 1
    fleet._scale(30.0, fleet._by_index)
    assert fleet.starting == 0
    assert sum(not r.draining for r in fleet.live) == 1


def test_the_hpa_never_raises_the_count_from_its_scale_down_window() -> None:
    keda = KedaScaler(1, 100, lag_threshold=10)
    assert keda.target(fleet_state(lag=200, starting=1)) == 5  # asked for 20, allowed 5 this period
    assert keda.target(fleet_state(now=5.0, lag=30, starting=5)) == 5  # asks 3: the window holds 20, kept 5
    assert keda.target(fleet_state(now=400.0, lag=0, starting=5)) == 1  # the window has passed


def test_the_fleet_shows_scalers_each_replicas_last_first_token_and_last_itl() -> None:
    seen: list[FleetState] = []

    class Watch(FixedTarget):
        interval_s = 0.5

        def target(self, state: FleetState) -> int:
            seen.append(
                dataclasses.replace(state, first_tokens=dict(state.first_tokens), itls=dict(state.itls))
            )
            return self.wanted

    fleet = Fleet(make_router("round-robin", 1), MODEL, 1, scaler=Watch(1), views="exact")
    r = request(1, "p", 40, 50, at=0.0)
    fleet.run(iter([r]), until=10.0, drain_s=0.0)
    assert r.done < 10.0
    during = [s for s in seen if r.first_token <= s.now < r.done]
    assert during
    assert all(s.first_tokens == {0: (640, r.first_token)} and not s.itls for s in during)
    after = [s for s in seen if s.now >= r.done]
    assert after
    assert all(s.itls == {0: pytest.approx((r.done - r.first_token) / 49)} for s in after)


def test_the_agg_planner_decode_side_reads_the_itl_gauge_against_decoding_blocks() -> None:
    planner = DynamoAggPlannerScaler(1, 64)
    decoding = []
    for i in range(2):
        replica = Replica(i, MODEL)
        replica.place(request(100 + i, f"d{i}", 10, 1000), 0.0)
        while not replica.running:
            replica.process(replica.next_event())
        decoding.append(replica)
    assert [r.running_blocks for r in decoding] == [10, 10]
    # 5 earlier points put the 50 ms ITL at 8 blocks; each replica decodes 10 blocks, past it.
    planner.itl_points.extend([(2.0, 0.02), (4.0, 0.03), (6.0, 0.04), (8.0, 0.05), (12.0, 0.07)])
    itls = {0: 0.06, 1: 0.06}
    assert planner.target(fleet_state(now=5.0, ready=decoding, itls=itls)) == 3
    assert list(planner.itl_points)[-2:] == [(10.0, 0.06), (10.0, 0.06)]
    # At its cap it still asks, and so waits for the deployment: no decision until the poll sees it ready.
    capped = DynamoAggPlannerScaler(1, 2)
    capped.itl_points.extend(planner.itl_points)
    assert capped.target(fleet_state(now=5.0, ready=decoding, itls=itls)) == 2
    assert capped.poll_at == 15.0


def test_the_lag_keda_reads_is_every_arrival_since_the_oldest_held_request() -> None:
    seen: list[FleetState] = []

    class Watch(FixedTarget):
        def target(self, state: FleetState) -> int:
            seen.append(state)
            return self.wanted

    # One replica of 2 slots behind a router that holds when the replica is full (llm-d with flow
    # control): held requests and the placed ones after the oldest are lag; an idle fleet has none.
    model = TimingModel(max_seqs=2, chunk_tokens=1000)
    fleet = Fleet(LlmdRouter(random.Random(1), flow_control=True), model, 1, scaler=Watch(1), views="exact")
    arrivals = [request(i, f"p{i}", 40, 2000, at=0.001 * i) for i in range(12)]
    fleet.run(iter(arrivals), until=20.0, drain_s=0.0)
    busy = [s for s in seen if s.held]
    assert busy, "some requests were held"
    assert all(s.lag >= s.held for s in busy)
    assert all(s.lag == 0 for s in seen if not s.held)


def test_the_hpa_adds_at_most_four_pods_or_doubles_per_period() -> None:
    keda = KedaScaler(1, 100, lag_threshold=10)
    assert keda.target(fleet_state(lag=1000, starting=1)) == 5  # max(1 + 4, 2 x 1)
    assert keda.target(fleet_state(now=5.0, lag=1000, starting=5)) == 5  # same period
    assert keda.target(fleet_state(now=20.0, lag=1000, starting=5)) == 10  # next: 2 x 5


def test_reactive_scales_with_requests_in_the_system() -> None:
    rule = ReactiveScaler(1, 20, concurrency=10, target=0.5)
    replicas = [Replica(i, MODEL) for i in range(2)]
    assert rule.target(fleet_state(backlog=30, ready=replicas)) == 6  # 30 in the system / (10 x 0.5)


def test_dynamo_planner_divides_the_predicted_rate_by_the_profile_and_corrects_only_down() -> None:
    planner = DynamoPlannerScaler(1, 20, capacity=9.0, expected_ttft_s=0.1, interval_s=180.0)
    assert planner.target(fleet_state(starting=3)) == 3  # nothing observed yet: keeps what it has
    # Fewer than 5 intervals: the predictor gives the last rate. 20 req/s over 9 per replica.
    assert planner.target(fleet_state(now=180.0, arrived=180 * 20, starting=3)) == 3
    # TTFT at twice the profile's: min(1, 2) leaves the count as it is.
    assert planner.target(fleet_state(now=360.0, arrived=180 * 40, starting=3, ttft_mean=0.2)) == 3
    # TTFT at half the profile's (cache hits the profile did not know): half the replicas.
    assert planner.target(fleet_state(now=540.0, arrived=180 * 60, starting=3, ttft_mean=0.05)) == 2
    uncorrected = DynamoPlannerScaler(1, 20, capacity=9.0, expected_ttft_s=0.1, correction=False)
    uncorrected.target(fleet_state())
    assert uncorrected.target(fleet_state(now=180.0, arrived=180 * 20, ttft_mean=0.05)) == 3


def test_the_arima_predictor_follows_dynamos_edge_cases_and_a_trend() -> None:
    p = ArimaPredictor()
    assert p.predict() == 0.0
    for v in (0.0, 0.0, 3.0, 4.0):  # leading zeros are skipped
        p.add(v)
    assert list(p.values) == [3.0, 4.0]
    assert p.predict() == 4.0  # fewer than 5: the last value
    flat = ArimaPredictor()
    for _ in range(8):
        flat.add(7.0)
    assert flat.predict() == 7.0
    ramp = ArimaPredictor()
    for v in range(1, 21):
        ramp.add(float(v) + (0.3 if v % 2 else -0.3))
    assert 20.0 < ramp.predict() < 22.5  # it continues the rise rather than repeating the last value


def test_llmd_wva_adds_one_replica_when_spare_capacity_is_short_and_removes_one_when_it_can() -> None:
    # (KV usage, waiting): spare KV 0.8 - KV and spare queue 5 - waiting over the unsaturated replicas.
    assert wva_decision(2, 0, [(0.75, 0.0), (0.75, 0.0)]) == 3  # spare KV 0.05 < 0.1
    assert wva_decision(2, 0, [(0.2, 3.0), (0.2, 3.0)]) == 3  # spare queue 2 < 3
    assert wva_decision(2, 1, [(0.75, 0.0), (0.75, 0.0)]) == 2  # one is still starting: wait for it
    assert wva_decision(3, 0, [(0.1, 0.0), (0.1, 0.0), (0.1, 0.0)]) == 2  # load fits on one fewer
    assert wva_decision(2, 0, [(0.4, 0.0), (0.4, 0.0)]) == 2  # one replica would be at 0.8: keep both
    assert wva_decision(2, 0, [(0.9, 0.0), (0.85, 6.0)]) == 3  # all saturated
    scaler = LlmdWvaScaler(1, 10, every_s=60.0)
    idle = [Replica(i, MODEL) for i in range(3)]
    assert scaler.target(fleet_state(now=0.0, ready=idle)) == 2
    assert scaler.target(fleet_state(now=30.0, ready=idle)) == 3  # between decisions: as it is


def test_the_agg_planners_fit_reads_the_load_at_the_sla_back_and_falls_back_on_a_flat_slope() -> None:
    line = [(float(x), 0.01 + 0.001 * x) for x in range(0, 50, 10)]  # ITL 10 ms + 1 ms per 1,000 blocks
    assert sla_load(line[:4], 0.05) is None  # fewer than 5 observations: no decision yet
    assert sla_load(line, 0.05) == pytest.approx(40.0)
    assert sla_load(line, 0.005) == 0.0  # under the intercept: clamped at no load
    flat = [(10.0, 0.02), (20.0, 0.02), (30.0, 0.06), (40.0, 0.02), (50.0, 0.01)]
    assert sla_load(flat, 0.05) == 10.0  # slope <= 0: the smallest load observed under the target
    assert sla_load([(5.0, 0.1)] * 5, 0.05) == 5.0  # none under it: the smallest load observed


def test_the_agg_planner_adds_when_every_replica_is_past_either_target_and_removes_only_under_both() -> None:
    def loads(*pairs: tuple[float, float]) -> list[WorkerLoad]:
        return [WorkerLoad(p, d) for p, d in pairs]

    # Prefill target: 3,000 tokens at the SLA less a mean prompt of 1,000; decode target 400 blocks.
    assert agg_planner_step(2, loads((2500, 10), (2100, 10)), 3000, 1000, 400) == 3  # prefill side
    assert agg_planner_step(2, loads((0, 500), (0, 450)), 3000, 1000, 400) == 3  # decode side
    assert agg_planner_step(2, loads((2500, 10), (100, 10)), 3000, 1000, 400) == 2  # not every replica
    # Down only when every replica is under both boundaries: target x (n - 1) / n x 0.8.
    assert agg_planner_step(2, loads((700, 150), (100, 10)), 3000, 1000, 400) == 1
    assert agg_planner_step(2, loads((700, 170), (100, 10)), 3000, 1000, 400) == 2  # 170 > 160
    assert agg_planner_step(1, loads((0, 0)), 3000, 1000, 400) == 1  # one replica never goes
    # A side without a target (cold start, or an SLA out of reach at the mean prompt) cannot scale down.
    assert agg_planner_step(2, loads((0, 0), (0, 0)), None, 1000, 400) == 2
    assert agg_planner_step(2, loads((0, 500), (0, 500)), 900, 1000, 400) == 3
    assert agg_planner_step(2, loads((0, 0), (0, 0)), 900, 1000, 400) == 2


def test_the_agg_planner_decides_every_5_s_and_waits_for_the_deployment_after_a_change() -> None:
    planner = DynamoAggPlannerScaler(1, 10)
    assert planner.interval_s == 0.5
    busy = [loaded(i, 6) for i in range(2)]
    assert [r.prefill_tokens() for r in busy] == [6784, 6784]  # a 400-block prompt and six of 4 blocks
    first = {i: (1_000, 2.0) for i in range(2)}  # last first token: 1,000-token prompt, TTFT 2 s
    # Earlier observations put the 500 ms TTFT at 3,000 tokens (prefill + prompt): 2,000 past the prompt.
    planner.ttft_points.extend([(1500.0, 0.25), (3000.0, 0.5), (6000.0, 1.0), (4500.0, 0.75), (750.0, 0.1)])
    load = 2 * 6784  # what the fleet reports: nothing held
    for k in range(10):  # ten samples, 0.5 s apart, before the loop's first decision
        state = fleet_state(now=0.5 * k, ready=busy, first_tokens=first, prefill_tokens=load)
        assert planner.target(state) == 2
    assert planner.target(fleet_state(now=5.0, ready=busy, first_tokens=first, prefill_tokens=load)) == 3
    assert list(planner.ttft_points)[-2:] == [(7784.0, 2.0), (7784.0, 2.0)]  # each replica's averages
    assert not planner.itl_points  # no ITL gauge yet: no decode observation
    # blocking=True: the deployment is polled every 10 s, and the loop sleeps 5 s after it is ready.
    for k in range(11, 50):  # starting until 20 s, seen ready at the 25 s poll
        starting = int(k < 40)
        state = fleet_state(
            now=0.5 * k, ready=busy, first_tokens=first, starting=starting, prefill_tokens=load
        )
        assert planner.target(state) == 2 + starting
    assert planner.target(fleet_state(now=25.0, ready=busy, first_tokens=first, prefill_tokens=load)) == 2
    assert planner.decide_at == 30.0
    assert planner.target(fleet_state(now=27.5, ready=busy, first_tokens=first, prefill_tokens=load)) == 2
    assert planner.target(fleet_state(now=30.0, ready=busy, first_tokens=first, prefill_tokens=load)) == 3


def test_the_agg_planner_counts_held_prompts_and_averages_only_the_gauges_a_replica_has() -> None:
    planner = DynamoAggPlannerScaler(1, 10)
    planner.ttft_points.extend([(1500.0, 0.25), (3000.0, 0.5), (6000.0, 1.0), (4500.0, 0.75), (750.0, 0.1)])
    idle = [Replica(i, MODEL) for i in range(2)]
    # Only replica 0 has a first token: the mean prompt is its 1,000 tokens, not 500 with replica 1's
    # missing gauge counted as 0, so the prefill target stays 2,000.
    # With this point the fit reaches 500 ms at 3,274 tokens: a target of 2,274 past the mean prompt.
    first = {0: (1_000, 0.3)}
    held = fleet_state(now=5.0, ready=idle, first_tokens=first, prefill_tokens=4_600)
    assert planner.target(held) == 3  # 4,600 held tokens: 2,300 a replica, both past the target
    assert list(planner.ttft_points)[-1] == (3300.0, 0.3)  # replica 1 adds no TTFT point
    fewer = DynamoAggPlannerScaler(1, 10)
    fewer.ttft_points.extend(list(planner.ttft_points)[:-1])
    assert fewer.target(fleet_state(now=5.0, ready=idle, first_tokens=first, prefill_tokens=4_200)) == 2


def loaded(index: int, waiting: int, model: TimingModel = MODEL) -> Replica:
    """A replica with `waiting` requests queued behind one long prompt in prefill."""
    replica = Replica(index, model)
    replica.place(request(10_000 + index, f"busy{index}", 400, 5), 0.0)
    for i in range(waiting):
        replica.place(request(20_000 + 100 * index + i, f"w{index}-{i}", 4, 5), 0.0)
    return replica


def test_llmd_as_deployed_never_holds_and_with_flow_control_holds_when_every_endpoint_is_saturated() -> None:
    saturated = [loaded(i, 6) for i in range(3)]
    assert all(r.queue >= 5 for r in saturated)
    assert LlmdRouter(random.Random(1)).route(request(1, "a", 10, 5), saturated, 0.0) is not None
    gated = LlmdRouter(random.Random(1), flow_control=True)
    assert gated.route(request(1, "a", 10, 5), saturated, 0.0) is None
    # One endpoint has room: the scorers choose among all endpoints, and the prefix wins over the queue.
    warm = loaded(3, 6)
    warm.cache.insert(blocks_of("a", 0, 10))
    idle = Replica(4, MODEL)
    assert gated.route(request(2, "a", 10, 5), [*saturated, warm, idle], 0.0) is warm


def test_llmd_scrapes_its_endpoints_every_50_ms() -> None:
    router = LlmdRouter(random.Random(1))
    fleet = Fleet(router, MODEL, 2, heartbeat_s=0.5)
    assert fleet.heartbeat_s == 0.05
    assert Fleet(make_router("sluice", 1), MODEL, 2, heartbeat_s=0.5).heartbeat_s == 0.5


def test_sglang_routes_a_miss_to_its_least_loaded_worker_and_a_hit_by_its_own_routing_history() -> None:
    router = SglangRouter(random.Random(1))
    a, b = Replica(0, MODEL), Replica(1, MODEL)
    b.cache.insert(blocks_of("other", 0, 600))  # an engine's cache is not the router's tree
    first = router.route(request(1, "x", 10, 5), [a, b], 0.0)
    assert first in (a, b)
    # The next miss goes to the other worker: the one with fewer requests in flight.
    second = router.route(request(2, "y", 10, 5), [a, b], 0.0)
    assert isinstance(first, Replica)
    assert isinstance(second, Replica)
    assert second is not first
    # A repeat of x's prompt matches the tree of the worker it was routed to (ratio 1 > 0.3).
    assert router.route(request(3, "x", 10, 5), [a, b], 0.0) is first
    # "other" is in b's engine cache but in no tree: a miss, to the least loaded.
    router.finished(_ended(request(1, "x", 10, 5), first), 1.0)
    router.finished(_ended(request(3, "x", 10, 5), first), 1.0)
    assert (router.load.count[first.index], router.load.count[second.index]) == (0, 1)
    assert router.route(request(4, "other", 10, 5), [a, b], 1.0) is first


def test_sglang_balances_only_past_both_of_its_launcher_thresholds() -> None:
    router = SglangRouter(random.Random(1))
    a, b = Replica(0, MODEL), Replica(1, MODEL)
    for rid in range(3):  # every request shares one prompt: the tree keeps them on one worker
        router.route(request(rid, "same", 10, 5), [a, b], 0.0)
    sticky = max((a, b), key=lambda r: router.load.count[r.index])
    router.load.count[sticky.index] = 64  # 64 - 0 is not over balance_abs_threshold 64
    assert router.route(request(10, "same", 10, 5), [a, b], 0.0) is sticky
    # 65 - 0 > 64 and 65 > 1.5 x 0: imbalanced, to the least loaded.
    assert router.route(request(11, "same", 10, 5), [a, b], 0.0) is not sticky


def _ended(r: Request, replica: Replica) -> Request:
    r.replica = replica.index
    return r


def test_dynamo_counts_a_tenants_shared_blocks_once_and_never_an_output() -> None:
    router = DynamoRouter(random.Random(1))
    a, b = Replica(0, MODEL), Replica(1, MODEL)
    tenant = blocks_of("tenant", 0, 50)
    for rid in range(4):  # the same tenant's requests: 50 shared blocks and 2 of their own each
        r = Request(rid, 0.0, tenant + blocks_of(f"q{rid}", 0, 2), 52 * 16, 10_000, max_tokens=10_000)
        assert router.route(r, [a], 0.0) is a
    assert len(router.active[0]) == 50 + 4 * 2  # unique active prompt blocks; no output blocks
    assert router.new_blocks(0, tenant + blocks_of("q9", 0, 2)) == 2
    # b is idle, a has four prompts in prefill. The tenant's next request still costs a less in decode
    # blocks (2 new against 52), and b less in prefill (52 blocks against 4 x 52 + 52): b wins on
    # prefill while a's prompts have not produced their first token.
    nxt = Request(9, 0.0, tenant + blocks_of("q9", 0, 2), 52 * 16, 5)
    assert router.route(nxt, [a, b], 0.0) is b
    # Once they have their first tokens (prefill dropped whole), compare a with c, which serves four
    # requests of other tenants: a costs 52 + (58 + 2) blocks, c 52 + (4 x 52 + 52).
    router2 = DynamoRouter(random.Random(1))
    c = Replica(2, MODEL)
    for rid in range(4):
        mine = Request(rid, 0.0, tenant + blocks_of(f"q{rid}", 0, 2), 52 * 16, 5)
        theirs = Request(10 + rid, 0.0, blocks_of(f"other{rid}", 0, 52), 52 * 16, 5)
        assert router2.route(mine, [a], 0.0) is a
        assert router2.route(theirs, [c], 0.0) is c
        mine.first_token = theirs.first_token = 0.5
    assert router2.prefill_tokens(0, 1.0) == router2.prefill_tokens(2, 1.0) == 0
    assert router2.route(Request(9, 1.0, tenant + blocks_of("q9", 0, 2), 52 * 16, 5), [a, c], 1.0) is a


def test_dynamo_releases_a_requests_blocks_and_prefill_when_it_ends() -> None:
    router = DynamoRouter(random.Random(1))
    a = Replica(0, MODEL)
    shared = blocks_of("t", 0, 10)
    one = Request(1, 0.0, shared + blocks_of("x", 0, 1), 11 * 16, 5)
    two = Request(2, 0.0, shared + blocks_of("y", 0, 1), 11 * 16, 5)
    router.route(one, [a], 0.0)
    router.route(two, [a], 0.0)
    assert len(router.active[0]) == 12
    assert router.prefill_tokens(0, 0.0) == 2 * 11 * 16
    one.replica = 0
    router.finished(one, 1.0)
    assert len(router.active[0]) == 11  # the shared blocks stay while two holds them
    assert router.prefill_tokens(0, 1.0) == 11 * 16
    two.replica = 0
    router.finished(two, 2.0)
    assert not router.active[0]
    assert router.prefill_tokens(0, 2.0) == 0


def test_dynamo_queues_only_while_every_worker_is_busy() -> None:
    router = DynamoRouter(random.Random(1), queue_threshold=0.5)  # busy above 500 prefill tokens
    a, b = Replica(0, MODEL), Replica(1, MODEL)
    for rid, replica in ((1, a), (2, b)):
        assert router.route(request(rid, f"p{rid}", 40, 5), [replica], 0.0) is replica  # 640 tokens
    assert router.route(request(3, "c", 10, 5), [a, b], 0.0) is None
    assert router.route(request(3, "c", 10, 5), [a, b, Replica(2, MODEL)], 0.0) is not None
    assert DynamoRouter(random.Random(1)).queue_threshold is None  # the 1.6.1 frontend: no queue


def test_llmd_predicted_latency_keeps_a_cached_tenant_where_it_has_headroom_and_else_goes_idle() -> None:
    router = LlmdPredictedLatencyRouter(random.Random(1), explore=0.0)
    # A model that has learned: TTFT grows with the waiting queue; TPOT is always within its SLO.
    router.ttft.coef = np.array([0.05, 0, 0, 0.5, 0, 0, 0, 0])
    router.tpot.coef = np.array([0.02, 0, 0, 0, 0])
    warm, cold, busy = loaded(0, 1), Replica(1, MODEL), loaded(2, 6)
    warm.cache.insert(blocks_of("a", 0, 10))
    # warm (prefix 1.0 >= 0.99) is gated in, and has headroom: 0.05 + 0.5 x 1 < 2 s.
    assert router.route(request(1, "a", 10, 5), [cold, warm, busy], 0.0) is warm
    # A pod matching 0.9 of the prompt (under the global gate's 0.99, over the tier gate's 0.80) with a
    # queue of 6 is predicted at 3.05 s: no headroom. The valid tier is the cold pod alone.
    partial = loaded(3, 6)
    partial.cache.insert(blocks_of("b", 0, 9))
    assert router.route(request(2, "b", 10, 5), [partial, cold], 0.0) is cold
    # With no valid pod at all (every TTFT predicted at 3 s or more), the gate still keeps a pod matching
    # 0.80 or more; among pods the gate lets through alike, an idle one is preferred.
    router.ttft.coef = np.array([3.0, 0, 0, 0.5, 0, 0, 0, 0])
    idle = Replica(5, MODEL)
    assert {router.route(request(3 + n, "b", 10, 5), [partial, busy, idle], 0.0) for n in range(10)} == {
        partial
    }
    assert {router.route(request(20 + n, "c", 10, 5), [partial, busy, idle], 0.0) for n in range(10)} == {
        idle
    }


def test_the_predicted_latency_model_learns_from_completions() -> None:
    router = LlmdPredictedLatencyRouter(random.Random(1))
    replicas = [Replica(i, MODEL) for i in range(2)]
    for rid in range(150):
        r = request(rid, f"p{rid}", 5 + rid % 20, 5)
        view = router.route(r, replicas, float(rid))
        assert view is not None
        r.replica, r.first_token, r.done = view.index, rid + 0.1 + 0.001 * r.prompt_tokens, rid + 1.0
        router.first_token(r, r.first_token)
        router.finished(r, rid + 1.0)
    assert router.ttft.trained
    features = np.array([1.0, 0, 320.0, 0, 0, 0, 320.0, 0])
    assert router.ttft.predict(features) == pytest.approx(0.1 + 0.32, abs=0.02)


def test_llmd_lora_lists_include_its_own_placements_since_the_scrape() -> None:
    replica = Replica(0, TimingModel(max_loras=2))
    view = Snapshot.of(replica)
    r = request(1, "a", 4, 2)
    r.adapter = 3
    assert 3 not in view.waiting_adapters()
    view.placed(r)
    assert 3 in view.waiting_adapters()


class Sealed(Request):
    """A request whose true output length a router must not read."""

    def __getattribute__(self, name: str) -> object:
        if name == "output_tokens":
            raise AssertionError("a router read the true output length")
        return super().__getattribute__(name)


@pytest.mark.parametrize("name", ROUTERS)
def test_no_router_reads_the_true_output_length(name: str) -> None:
    replicas = [loaded(i, 2) for i in range(3)]
    snapshots = [Snapshot.of(r) for r in replicas]
    router = make_router(name, 1)
    for views in (replicas, snapshots):
        router.observe(views, 0.0)
        probe = Sealed(99, 0.0, blocks_of("busy0", 0, 20), 320, 0, max_tokens=64)
        probe.__dict__["output_tokens"] = 7  # set, but sealed against reading
        router.route(probe, views, 0.0)


def test_a_heartbeat_view_shows_the_cache_as_reported_plus_the_routers_own_placements() -> None:
    replica = Replica(0, MODEL)
    view = Snapshot.of(replica)
    run_alone(replica, request(1, "a", 20, 2))
    assert replica.matched(blocks_of("a", 0, 20)) == 20
    assert view.matched(blocks_of("a", 0, 20)) == 0  # not reported yet
    view.refresh()
    assert view.matched(blocks_of("a", 0, 20)) == 20
    before, free = view.queue, view.free_blocks
    view.placed(request(2, "b", 20, 2))
    assert view.queue == before + 1
    assert view.free_blocks == free - 20  # its prompt's blocks; its output's come as it is generated
    assert view.matched(blocks_of("b", 0, 20)) == 0  # the cache as reported: placing does not fill it
    assert view.indexed(blocks_of("a", 0, 20)) == 20  # the KV-event index reads the replica's own


def test_the_sketch_answers_quantiles_within_its_accuracy() -> None:
    rng = random.Random(5)
    values = [rng.lognormvariate(-3, 1.5) for _ in range(20_000)] + [0.0] * 100
    sketch = Sketch(0.005)
    for v in values:
        sketch.add(v)
    for q in (0.01, 0.5, 0.9, 0.99, 0.999):
        exact = percentile(values, q)
        assert sketch.quantile(q) == pytest.approx(exact, rel=0.0051, abs=1e-12)


def test_sluice_places_a_tenants_repeat_requests_where_its_prefix_is_cached() -> None:
    """30 tenants' 2,000-token contexts need 3,750 blocks; each replica has 4,000, less its running work.

    sluice's prefix term sends a tenant's requests where its context is cached unless the load forbids
    it, so at this load every request after a tenant's first (or, with heartbeat views, the few sent
    before the first one's blocks were reported) finds its context.
    """
    workload = shared_prefix(rate=20.0, tenants=30, context=2000, duration_s=60.0)
    model = TimingModel(kv_blocks=4000)
    for views in ("exact", "heartbeat"):
        out = simulate(functools.partial(make_router, "sluice", 3), model, workload.requests, 60.0, 4,
                       views=views, by_minute=True)  # fmt: skip
        s = summarize(out)
        assert out.unfinished == 0
        assert s.finished > 1000
        assert s.cold <= 30 + 10, (views, s.cold)  # a tenant's first request, and rarely a second
        assert s.hit_rate > 0.9
        assert violation_minutes(out.stats, 60.0, 2.0, out.unfinished) == 0
    assert violation_minutes(Stats(minutes={}), 60.0, 2.0, unfinished=1) == 1


# prefill/decode disaggregation (bench/sim/disagg.py)
def test_a_loaded_prompt_is_not_prefilled_again_on_the_decode_replica() -> None:
    loaded = request(1, "p", 40, 5)
    loaded.loaded = True
    cold = request(2, "q", 40, 5)
    times = []
    for r in (loaded, cold):
        replica = Replica(0, MODEL)
        run_alone(replica, r)
        times.append(r.first_token - r.arrival)
    assert loaded.cached_tokens == 40 * 16
    assert times[0] < times[1] / 2


def split_run(policy: str, prefill: int) -> SplitResult:
    workload = shared_prefix(rate=8.0, tenants=4, context=2000, duration_s=20.0)
    fleet = SplitFleet(SplitRun(policy, 4, prefill), MODEL, seed=3)
    return fleet.run_all(workload.requests(random.Random(3)), workload.duration_s)


def test_the_split_fleet_finishes_every_request_under_every_policy() -> None:
    from bench.sim.disagg import SplitResult

    results = {
        p: split_run(p, 0 if p == "never" else 1) for p in ("never", "always", "threshold:512", "auto")
    }
    for policy, result in results.items():
        assert isinstance(result, SplitResult)
        assert result.unfinished == 0, policy
        assert result.finished > 100, policy
    counts = {p: r.split for p, r in results.items() if isinstance(r, SplitResult)}
    finished = {p: r.finished for p, r in results.items() if isinstance(r, SplitResult)}
    assert counts["never"] == 0
    assert counts["always"] == finished["always"]
    # The threshold rule splits the cold prompts (2000 uncached tokens), not the warm ones.
    assert 0 < counts["threshold:512"] < finished["threshold:512"]
    # `auto` prices each cold prompt: at this light load a local prefill mostly wins (a decode worker
    # seldom has others to stall), so it splits some cold prompts and fewer than the threshold rule.
    assert 0 < counts["auto"] < counts["threshold:512"]


def test_the_aggregated_baseline_has_no_prefill_replicas() -> None:
    with pytest.raises(ValueError, match="no prefill workers"):
        SplitFleet(SplitRun("never", 4, 1), MODEL, seed=1)


def test_a_seed_range_is_shown_only_when_it_differs_as_printed() -> None:
    assert spread("98.1%", "98.1%") == ""  # seeds apart by less than the shown precision
    assert spread("63.0%", "100.0%") == " [63.0%-100.0%]"


def test_scaling_points_read_the_medians_of_a_printed_table() -> None:
    table = "\n".join(
        [
            "| scaler | setting | SLO-violation minutes | GPU-hours | p90 TTFT s | p99 TTFT s "
            "| peak replicas | unfinished |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            "| sluice | target utilisation 0.8 | 4 | 166 [159-167] | 0.081 | 0.34 | 16 [14-17] | 0 |",
            "| dynamo-planner | 60 s, corrected | 39 [30-41] | 10 | 0.3 | 0.8 | 8 | 0 |",
            "| not-a-rule | x | 1 | 2 | 3 | 4 | 5 | 6 |",
        ]
    )
    assert scaling_points(table) == {
        "sluice": [("target utilisation 0.8", 166.0, 4.0)],
        "dynamo-planner": [("60 s, corrected", 10.0, 39.0)],
    }


def test_line_styles_differ_for_every_line_up_to_forty() -> None:
    colours = 10
    looks = {(n % colours, tuple(sorted(line_style(n).items()))) for n in range(40)}
    assert len(looks) == 40


def test_the_latency_models_error_is_measured_on_every_first_token_and_is_small_off_saturation() -> None:
    """`python -m bench.sim error`'s measurement: one relative error per placement's first token; on a
    light shared-prefix load (10 req/s over 8 replicas) the corrected prediction is mostly right."""
    run = Run("shared-prefix", (("rate", 10.0), ("duration_s", 60.0)), "sluice", 1, "heartbeat")
    median, p90, count = model_error_one(run)
    assert count > 500  # about 600 requests, all started
    assert 0 <= median <= p90
    assert median < 0.25
