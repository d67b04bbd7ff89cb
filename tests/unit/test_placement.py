import random
from collections.abc import Callable

import numpy as np
import pytest

from dispatcher.placement import (
    AFFINITY_REASON,
    Decision,
    Demand,
    PlacementPolicy,
    WorkerSnapshot,
    blocks_needed,
    choose,
    is_eligible,
    least_loaded,
    queue_depth,
    queue_full,
    rejection,
)
from dispatcher.table import WorkerTable, choose_fast
from queue_schemas.messages import Heartbeat, Priority, WorkerState

NOW = 1000.0
POLICY = PlacementPolicy(queue_depth="fixed", objective="score")  # the scorers; tests/unit/test_latency.py
# has the latency objective. The derived depth has its own tests below.
HASHES = [f"h{i}" for i in range(8)]  # an 8-block prompt of 128 tokens (block size 16)


def beat(
    worker_id: str,
    *,
    running: int = 0,
    waiting: int = 0,
    free: int = 1000,
    total: int = 1000,
    state: WorkerState = WorkerState.READY,
    age: float = 0.1,
    max_running: int = 0,
    completed_per_s: float = 0.0,
    light_slots: int = 0,
) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, pool="sim", model="m", state=state, seq=1, sent_at=NOW - age, ttl_ms=3000,
        kv_blocks_total=total, kv_blocks_free=free, block_size=16, running=running, waiting=waiting,
        inbox_pending=0, max_running=max_running, decode_tokens_per_s=0.0, started_at=0.0,
        completed_per_s=completed_per_s, light_slots=light_slots,
    )  # fmt: skip


def demand(max_tokens: int = 64, priority: Priority = Priority.INTERACTIVE) -> Demand:
    return Demand(prompt_tokens=128, block_hashes=HASHES, max_tokens=max_tokens, priority=priority)


def test_blocks_needed_counts_uncached_prompt_and_expected_output() -> None:
    assert blocks_needed(demand(64), 0, 16, POLICY) == (128 + 64) // 16
    assert blocks_needed(demand(64), 6, 16, POLICY) == (32 + 64) // 16
    assert blocks_needed(demand(10_000), 0, 16, POLICY) == (128 + 256) // 16  # output capped


@pytest.mark.parametrize(
    ("snapshot", "reason"),
    [
        (WorkerSnapshot(beat("a", age=3.5)), "not ready or stale"),
        (WorkerSnapshot(beat("a", state=WorkerState.STARTING)), "not ready or stale"),
        (WorkerSnapshot(beat("a", state=WorkerState.DRAINING)), "not ready or stale"),
        (WorkerSnapshot(beat("a", waiting=64)), "queue full"),
        (WorkerSnapshot(beat("a"), in_flight=64), "queue full"),
        (WorkerSnapshot(beat("a", free=50)), "not enough free KV blocks"),
        (WorkerSnapshot(beat("a", free=100), in_flight_blocks=40), "not enough free KV blocks"),
    ],
)
def test_each_hard_filter(snapshot: WorkerSnapshot, reason: str) -> None:
    assert rejection(snapshot, demand(), NOW, POLICY) == reason
    assert choose([snapshot], demand(), NOW, POLICY, random.Random(0)).worker_id is None


def test_cached_prefix_lowers_the_blocks_a_full_worker_needs() -> None:
    tight = WorkerSnapshot(beat("a", free=60, total=1000), matched_blocks=8)
    assert rejection(tight, demand(), NOW, POLICY) is None
    assert rejection(WorkerSnapshot(beat("a", free=60, total=1000)), demand(), NOW, POLICY) is not None


def test_batch_needs_spare_headroom_interactive_does_not() -> None:
    half_full = WorkerSnapshot(beat("a", free=250, total=1000))
    assert rejection(half_full, demand(priority=Priority.INTERACTIVE), NOW, POLICY) is None
    assert rejection(half_full, demand(priority=Priority.BATCH), NOW, POLICY) == "no headroom left for batch"


def test_batch_leaves_running_slots_for_interactive_requests() -> None:
    """With 16 slots and a quarter kept back, batch may bring a worker's load up to 12 requests."""
    eleven = WorkerSnapshot(beat("a", running=10, max_running=16), in_flight=1)
    twelve = WorkerSnapshot(beat("a", running=10, max_running=16), in_flight=2)
    assert rejection(eleven, demand(priority=Priority.BATCH), NOW, POLICY) is None
    assert rejection(twelve, demand(priority=Priority.BATCH), NOW, POLICY) == "no headroom left for batch"
    assert rejection(twelve, demand(priority=Priority.INTERACTIVE), NOW, POLICY) is None


def test_prefix_term_wins_over_a_small_load_difference() -> None:
    cached = WorkerSnapshot(beat("cached", waiting=2), matched_blocks=8)
    idle = WorkerSnapshot(beat("idle"))
    assert choose([cached, idle], demand(), NOW, POLICY, random.Random(0)).worker_id == "cached"


def test_queue_term_wins_when_the_cached_worker_is_swamped() -> None:
    swamped = WorkerSnapshot(beat("cached", waiting=40), matched_blocks=2)
    idle = WorkerSnapshot(beat("idle"))
    assert choose([swamped, idle], demand(), NOW, POLICY, random.Random(0)).worker_id == "idle"


def test_kv_term_prefers_headroom() -> None:
    full = WorkerSnapshot(beat("full", free=200))
    empty = WorkerSnapshot(beat("empty", free=1000))
    assert choose([full, empty], demand(), NOW, POLICY, random.Random(0)).worker_id == "empty"


def test_in_flight_accounting_spreads_a_burst() -> None:
    """Between heartbeats, what was just placed counts, so a burst does not pile onto one worker."""
    rng = random.Random(0)
    placed: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    for _ in range(30):
        workers = [WorkerSnapshot(beat(w), in_flight=n, in_flight_blocks=n * 12) for w, n in placed.items()]
        chosen = choose(workers, demand(), NOW, POLICY, rng).worker_id
        assert chosen is not None
        placed[chosen] += 1
    assert sorted(placed.values()) == [10, 10, 10]


def test_decision_reports_match_and_blocks() -> None:
    decision = choose([WorkerSnapshot(beat("a"), matched_blocks=4)], demand(), NOW, POLICY, random.Random(0))
    assert (decision.worker_id, decision.matched_blocks, decision.blocks_needed) == ("a", 4, (64 + 64) // 16)


def test_no_candidate_names_the_commonest_reason() -> None:
    workers = [WorkerSnapshot(beat(w, waiting=64)) for w in "ab"] + [WorkerSnapshot(beat("c", age=9))]
    assert choose(workers, demand(), NOW, POLICY, random.Random(0)).reason == "queue full"


def test_ties_are_broken_at_random() -> None:
    workers = [WorkerSnapshot(beat(w)) for w in "abc"]
    rng = random.Random(1)
    assert {choose(workers, demand(), NOW, POLICY, rng).worker_id for _ in range(60)} == {"a", "b", "c"}


def test_least_loaded_baseline() -> None:
    workers = [WorkerSnapshot(beat("a", running=3)), WorkerSnapshot(beat("b", running=1))]
    assert least_loaded(workers, NOW, random.Random(0)) == "b"
    assert not is_eligible(WorkerSnapshot(beat("x", age=5)), NOW)


SPILL = PlacementPolicy(spill_tokens=64, spill_after_s=5.0)  # 4 blocks of 16 tokens


def affinity_case(waited_s: float, cached_blocks: int) -> tuple[list[WorkerSnapshot], Demand]:
    busy = WorkerSnapshot(beat("cached", waiting=64), matched_blocks=cached_blocks)  # queue full
    cold = WorkerSnapshot(beat("cold"), matched_blocks=1)
    held = Demand(prompt_tokens=128, block_hashes=HASHES, max_tokens=64, waited_s=waited_s)
    return [busy, cold], held


def fast_choice(workers: list[WorkerSnapshot], held: Demand) -> Decision:
    table = WorkerTable()
    for w in workers:
        table.upsert(w.heartbeat, w.in_flight, w.in_flight_blocks)
    matched = np.array([float(w.matched_blocks) for w in workers])
    return choose_fast(table, matched, held, NOW, SPILL, random.Random(0))


@pytest.mark.parametrize("pick", [lambda ws, d: choose(ws, d, NOW, SPILL, random.Random(0)), fast_choice])
def test_a_request_waits_for_the_busy_worker_holding_its_prefix_then_spills(
    pick: Callable[[list[WorkerSnapshot], Demand], Decision],
) -> None:
    workers, fresh = affinity_case(waited_s=1.0, cached_blocks=8)  # 7 blocks (112 tokens) more elsewhere
    waiting = pick(workers, fresh)
    assert (waiting.worker_id, waiting.reason) == (None, AFFINITY_REASON)
    workers, old = affinity_case(waited_s=5.0, cached_blocks=8)
    assert pick(workers, old).worker_id == "cold"  # held long enough: it goes where it fits
    workers, small = affinity_case(waited_s=1.0, cached_blocks=4)  # 3 blocks (48 tokens) more: not worth it
    assert pick(workers, small).worker_id == "cold"


DERIVED = PlacementPolicy(refill_s=0.1, min_queue=2, max_queue=64)


def test_derived_depth_is_what_the_worker_finishes_while_it_is_refilled() -> None:
    assert queue_depth(beat("a", completed_per_s=50.0), DERIVED) == 5  # 50/s x 0.1 s
    assert queue_depth(beat("a", completed_per_s=51.0), DERIVED) == 6  # rounded up
    assert queue_depth(beat("a", completed_per_s=3.0), DERIVED) == 2  # at least min_queue
    assert queue_depth(beat("a", completed_per_s=0.0), DERIVED) == 2  # a new worker
    assert queue_depth(beat("a", completed_per_s=5000.0), DERIVED) == 64  # at most max_queue
    assert queue_depth(beat("a", completed_per_s=50.0), POLICY) == 64  # fixed: the cap, whatever the rate


def test_derived_depth_counts_what_waits_beyond_the_running_slots() -> None:
    # 16 slots, 50 finished per second: 5 may wait. 16 running and 4 just placed leave room for one more.
    hb = beat("a", running=16, max_running=16, completed_per_s=50.0)
    assert not queue_full(WorkerSnapshot(hb, in_flight=4), DERIVED)
    assert queue_full(WorkerSnapshot(hb, in_flight=5), DERIVED)
    assert rejection(WorkerSnapshot(hb, in_flight=5), demand(), NOW, DERIVED) == "queue full"
    # An idle worker takes a burst up to its slots plus its depth before its next heartbeat.
    idle = beat("b", max_running=16, completed_per_s=50.0)
    assert not queue_full(WorkerSnapshot(idle, in_flight=20), DERIVED)
    assert queue_full(WorkerSnapshot(idle, in_flight=21), DERIVED)
    # The fixed cap lets 64 wait on the same worker.
    assert not queue_full(WorkerSnapshot(hb, in_flight=63), POLICY)
    assert queue_full(WorkerSnapshot(hb, in_flight=64), POLICY)


def test_a_request_for_an_adapter_prefers_a_worker_that_holds_it() -> None:
    holds = beat("a").model_copy(update={"adapters": ("sql", "poem")})
    lacks = beat("b").model_copy(update={"adapters": ("poem",)})
    for_sql = Demand(prompt_tokens=128, block_hashes=HASHES, max_tokens=64, adapter="sql")
    rng = random.Random(0)
    picks = {
        choose([WorkerSnapshot(holds), WorkerSnapshot(lacks)], for_sql, NOW, POLICY, rng).worker_id
        for _ in range(20)
    }
    assert picks == {"a"}
    # Without an adapter, neither is preferred.
    picks = {
        choose([WorkerSnapshot(holds), WorkerSnapshot(lacks)], demand(), NOW, POLICY, rng).worker_id
        for _ in range(40)
    }
    assert picks == {"a", "b"}
    # Holding the adapter does not outweigh a worker that holds the whole prompt's prefix.
    cached = WorkerSnapshot(lacks, matched_blocks=len(HASHES))
    assert choose([WorkerSnapshot(holds), cached], for_sql, NOW, POLICY, rng).worker_id == "b"


def test_a_light_request_may_go_past_the_depth_by_the_workers_light_slots() -> None:
    # 16 slots and 1 light slot, 5 may wait, 5 just placed: full for a request of a team with a backlog,
    # one more for a team with nothing else held.
    hb = beat("a", running=16, max_running=16, completed_per_s=50.0, light_slots=1)
    full = WorkerSnapshot(hb, in_flight=5)
    assert queue_full(full, DERIVED)
    assert not queue_full(full, DERIVED, light=True)
    assert rejection(full, Demand(64, [], 16, light=True), NOW, DERIVED) is None
    assert queue_full(WorkerSnapshot(hb, in_flight=6), DERIVED, light=True)
    # A worker without light slots gives a light request nothing extra.
    plain = beat("b", running=16, max_running=16, completed_per_s=50.0)
    assert queue_full(WorkerSnapshot(plain, in_flight=5), DERIVED, light=True)


def test_a_queue_inside_the_engine_with_slots_free_is_bounded_by_the_cap() -> None:
    # Slots free but the engine short of KV blocks: 60 wait there (interactive work would go ahead of
    # batch work among them); the cap of 64 still bounds what queues.
    hb = beat("a", running=4, waiting=60, max_running=128, completed_per_s=50.0)
    assert not queue_full(WorkerSnapshot(hb, in_flight=3), DERIVED)
    assert queue_full(WorkerSnapshot(hb, in_flight=4), DERIVED)


def test_derived_depth_without_known_slots_bounds_the_queue() -> None:
    hb = beat("a", waiting=1, completed_per_s=50.0)  # max_running 0: slots unknown
    assert not queue_full(WorkerSnapshot(hb, in_flight=3), DERIVED)
    assert queue_full(WorkerSnapshot(hb, in_flight=4), DERIVED)
