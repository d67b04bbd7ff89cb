"""The fleet simulator: its engine model, its views, each baseline's published rule on small hand-made
states, and what sluice's own placement guarantees in a small fleet run."""

from __future__ import annotations

import functools
import math
import random

import pytest

from bench.sim.disagg import SplitFleet, SplitResult, SplitRun, spread
from bench.sim.engine import Replica, Request, Seq, TimingModel, leading_cached
from bench.sim.fleet import FleetState, simulate
from bench.sim.metrics import Sketch, Stats, percentile, summarize, violation_minutes
from bench.sim.routers import ROUTERS, DynamoRouter, LlmdRouter, SglangRouter, make_router
from bench.sim.scalers import DynamoPlannerScaler, KedaScaler, LlmdTokenScaler, ReactiveScaler
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
    model = TimingModel(kv_blocks=300, chunk_tokens=4096, scheduling="priority")
    replica = Replica(0, model)
    old, new = batch(request(1, "o", 20, 1600)), batch(request(2, "n", 20, 1600, at=0.001))  # 120 blocks
    replica.place(old, old.arrival)
    replica.place(new, new.arrival)
    while math.isnan(new.first_token):
        replica.process(replica.next_event())
    replica.advance(1.0)  # both decoding
    urgent = request(3, "i", 20, 1600, at=1.0)  # 120 blocks: only 60 free
    replica.place(urgent, 1.0)
    assert (old.preempted, new.preempted, replica.preemptions) == (0, 1, 1)
    assert replica.free_blocks == 300 - 240
    drain(replica)
    assert new.done > urgent.done  # it waited for blocks, then computed its prompt and output again
    assert replica.free_blocks == 300
    assert not replica.waiting
    assert replica.completed == 3


def test_fcfs_never_preempts() -> None:
    replica = Replica(0, TimingModel(kv_blocks=300, chunk_tokens=4096))
    first = batch(request(1, "o", 20, 1600))
    replica.place(first, 0.0)
    replica.place(request(2, "i", 20, 3200, at=0.5), 0.5)
    replica.place(request(3, "j", 20, 1600, at=0.6), 0.6)
    drain(replica)
    assert replica.preemptions == 0


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
    assert keda.target(fleet_state(backlog=95, starting=10)) == 10
    assert keda.target(fleet_state(now=30.0, starting=10)) == 10  # stabilised
    assert keda.target(fleet_state(now=400.0, starting=10)) == 1
    assert KedaScaler(1, 20, lag_threshold=50).target(fleet_state(backlog=95, starting=2)) == 2


def test_the_hpa_adds_at_most_four_pods_or_doubles_per_period() -> None:
    keda = KedaScaler(1, 100, lag_threshold=10)
    assert keda.target(fleet_state(backlog=1000, starting=1)) == 5  # max(1 + 4, 2 x 1)
    assert keda.target(fleet_state(now=5.0, backlog=1000, starting=5)) == 5  # same period
    assert keda.target(fleet_state(now=20.0, backlog=1000, starting=5)) == 10  # next: 2 x 5


def test_reactive_scales_with_requests_in_the_system() -> None:
    rule = ReactiveScaler(1, 20, concurrency=10, target=0.5)
    replicas = [Replica(i, MODEL) for i in range(2)]
    assert rule.target(fleet_state(backlog=30, ready=replicas)) == 6  # 30 in the system / (10 x 0.5)


def test_dynamo_planner_divides_the_corrected_rate_by_the_profiled_capacity() -> None:
    planner = DynamoPlannerScaler(1, 20, capacity=9.0, expected_ttft_s=0.1, interval_s=180.0)
    assert planner.target(fleet_state(starting=3)) == 3  # nothing observed yet: keeps what it has
    assert planner.target(fleet_state(now=180.0, arrived=180 * 20, starting=3)) == 3  # 20 req/s / 9
    assert planner.target(fleet_state(now=360.0, arrived=180 * 21, starting=3)) == 1  # 1 req/s
    # TTFT at twice the profile's: the corrected load is 2 x 20 req/s.
    assert planner.target(fleet_state(now=540.0, arrived=180 * 41, starting=3, ttft_mean=0.2)) == 5


def test_llmd_token_rule_keeps_the_backlog_within_the_ttft_slo() -> None:
    rule = LlmdTokenScaler(1, 20, prefill_tokens_per_s=12_500, ttft_slo_s=2.0)
    assert rule.target(fleet_state(prefill_tokens=100_000, starting=1)) == 4  # 8 s of prefill / 2 s


def loaded(index: int, waiting: int, model: TimingModel = MODEL) -> Replica:
    """A replica with `waiting` requests queued behind one long prompt in prefill."""
    replica = Replica(index, model)
    replica.place(request(10_000 + index, f"busy{index}", 400, 5), 0.0)
    for i in range(waiting):
        replica.place(request(20_000 + 100 * index + i, f"w{index}-{i}", 4, 5), 0.0)
    return replica


def test_llmd_holds_when_no_endpoint_has_capacity_and_does_not_spread() -> None:
    router = LlmdRouter(random.Random(1))
    saturated = [loaded(i, 6) for i in range(3)]
    assert all(r.queue >= 5 for r in saturated)
    assert router.route(request(1, "a", 10, 5), saturated, 0.0) is None
    # One endpoint has room: the scorers choose among all endpoints, and the prefix wins over the queue.
    warm = loaded(3, 6)
    warm.cache.insert(blocks_of("a", 0, 10))
    idle = Replica(4, MODEL)
    chosen = router.route(request(2, "a", 10, 5), [*saturated, warm, idle], 0.0)
    assert chosen is warm
    assert LlmdRouter(random.Random(1), flow_control=False).route(request(3, "a", 10, 5), saturated, 0.0)


def test_sglang_falls_back_to_the_smallest_tree_not_the_least_loaded() -> None:
    router = SglangRouter(random.Random(1))
    big_idle, small_busy = Replica(0, MODEL), loaded(1, 3)
    big_idle.cache.insert(blocks_of("other", 0, 600))
    assert big_idle.in_system < small_busy.in_system
    assert big_idle.cache_size > small_busy.cache_size
    assert router.route(request(1, "new", 10, 5), [big_idle, small_busy], 0.0) is small_busy
    # Above the match threshold it follows the match.
    assert router.route(request(2, "other", 10, 5), [big_idle, small_busy], 0.0) is big_idle


def test_dynamo_queues_only_while_every_worker_is_busy() -> None:
    router = DynamoRouter(random.Random(1), queue_threshold=0.5)  # busy above 500 prefill tokens
    busy = [loaded(i, 0) for i in range(2)]  # 6,400 tokens in prefill each
    assert all(r.prefill_tokens() > 500 for r in busy)
    assert router.route(request(1, "a", 10, 5), busy, 0.0) is None
    assert router.route(request(1, "a", 10, 5), [*busy, Replica(2, MODEL)], 0.0) is not None
    assert DynamoRouter(random.Random(1), queue_threshold=None).route(request(1, "a", 10, 5), busy, 0.0)


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
    before = view.queue
    view.placed(request(2, "b", 20, 2), record=True)
    assert view.queue == before + 1
    assert view.matched(blocks_of("b", 0, 20)) == 20
    assert replica.matched(blocks_of("b", 0, 20)) == 0


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
