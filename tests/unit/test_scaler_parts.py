"""Burrow lag status, replica measures, speculative-decoding policy and the local backend's choices."""

import pytest

from ingress.pool_gate import pool_refusal
from queue_schemas.config import PoolConfig, ScalingConfig
from queue_schemas.messages import POOL_STATE_STALE_S, Heartbeat, WorkerState
from scaler.backends import next_worker_id, pick_to_drain
from scaler.burrow import LagWindow, Status, partition_status, pool_status
from scaler.lag import pool_lag, pool_state, pool_state_ttl_ms
from scaler.signals import ReplicaMeasures, pool_signals, spec_decoding_on


@pytest.mark.parametrize(
    ("points", "consumers", "status"),
    [
        ([(0, 10, 5), (1, 15, 0), (2, 15, 3)], True, Status.OK),  # caught up at some point
        ([(0, 10, 5), (1, 10, 8), (2, 10, 9)], True, Status.STALL),  # commits not moving
        ([(0, 10, 5), (1, 10, 8)], False, Status.STOP),  # nobody consuming
        ([(0, 10, 5), (1, 8, 8)], True, Status.REWIND),
        ([(0, 10, 5), (1, 12, 7), (2, 14, 9)], True, Status.WARN),  # lag only grows
        ([(0, 10, 9), (1, 14, 7), (2, 18, 8)], True, Status.OK),  # lag went down: keeping up
        ([], True, Status.OK),
    ],
)
def test_partition_status(points: list[tuple[float, int, int]], consumers: bool, status: Status) -> None:
    assert partition_status(points, consumers) is status


def test_pool_status_is_the_worst_partition() -> None:
    assert pool_status({0: Status.OK, 1: Status.WARN}) is Status.WARN
    assert pool_status({0: Status.OK, 1: Status.STALL}) is Status.ERR
    assert pool_status({}) is Status.OK
    window = LagWindow(size=2)
    for t, (committed, lag) in enumerate([(1, 5), (1, 6), (1, 7)]):
        window.record(t, 0, committed, lag)
    assert window.statuses(has_consumers=True) == {0: Status.STALL}


def beat(worker: str, state: WorkerState = WorkerState.READY, **fields: float) -> Heartbeat:
    values: dict[str, float] = {
        "running": 0, "waiting": 0, "inbox_pending": 0, "completed_per_s": 0.0, "started_at": 100.0,
        "sent_at": 1000.0, "kv_blocks_total": 10, "kv_blocks_free": 10,
    }  # fmt: skip
    values.update(fields)
    return Heartbeat(
        worker_id=worker, pool="p", model="m", state=state, seq=1, ttl_ms=3000, block_size=16,
        decode_tokens_per_s=0.0, **values,  # type: ignore[arg-type]
    )  # fmt: skip


def test_measures_follow_busy_replicas_and_first_ready_times() -> None:
    m = ReplicaMeasures(capacity_default=4.0, startup_default=180.0)
    m.observe([beat("a", completed_per_s=9.0, ready_at=160.0)])  # idle: not a capacity sample
    assert m.capacity.value == 4.0
    assert m.startup.value == 60.0
    m.observe([beat("a", completed_per_s=1.0, waiting=3, ready_at=990.0)])  # ready 10 s: not settled
    assert m.capacity.value == 4.0
    m.observe([beat("a", completed_per_s=9.0, waiting=3, ready_at=160.0)])
    assert m.capacity.value == 9.0
    assert m.startup.samples == 1, "a worker's start-up counts once"


def test_capacity_is_sampled_only_where_slots_or_kv_are_full() -> None:
    m = ReplicaMeasures(capacity_default=4.0, startup_default=180.0)
    # A request waits (behind a prefill) while slots are free: its completions are not what it can do.
    m.observe([beat("a", completed_per_s=2.0, waiting=1, running=3, max_running=8, ready_at=160.0)])
    assert m.capacity.value == 4.0
    m.observe([beat("a", completed_per_s=7.0, waiting=1, running=8, max_running=8, ready_at=160.0)])
    assert m.capacity.value == 7.0
    m.observe([beat("b", completed_per_s=5.0, waiting=2, running=5, max_running=8, ready_at=160.0,
                    kv_blocks_free=0)])  # fmt: skip
    assert m.capacity.samples == 2, "full KV is saturated too"
    # Slots taken are running + waiting: prompts the engine's step has not reached count as waiting.
    m.observe([beat("c", completed_per_s=6.0, waiting=2, running=6, max_running=8, ready_at=160.0)])
    assert m.capacity.samples == 3


def test_pool_signals_count_states_backlog_and_launching() -> None:
    m = ReplicaMeasures(4.0, 180.0)
    beats = [
        beat("a", inbox_pending=3),
        beat("b", WorkerState.STARTING),
        beat("c", WorkerState.DRAINING),
        beat("old", sent_at=900.0),  # expired
    ]
    s = pool_signals(1000.0, lag=10, beats=beats, launching=1, arrival_rate=1.0, arrival_trend=0.0,
                     measures=m)  # fmt: skip
    # Held requests are inside the lag (uncommitted); inbox entries are placed and committed.
    assert (s.ready, s.starting, s.draining, s.backlog) == (1, 2, 1, 13)


def test_spec_decoding_auto_has_hysteresis() -> None:
    assert spec_decoding_on("on", [50.0], False, 4, 8)
    assert not spec_decoding_on("off", [0.0], True, 4, 8)
    assert spec_decoding_on("auto", [3.0, 4.0], False, 4, 8)
    assert not spec_decoding_on("auto", [6.0], False, 4, 8), "between the marks, off stays off"
    assert spec_decoding_on("auto", [6.0], True, 4, 8), "between the marks, on stays on"
    assert not spec_decoding_on("auto", [9.0, 8.0], True, 4, 8)
    assert spec_decoding_on("auto", [], True, 4, 8)


def test_local_backend_drains_the_least_busy_owned_replica_and_names_new_ones() -> None:
    beats = [beat("p-w0", running=3), beat("p-w1", running=1), beat("ext", running=0),
             beat("p-w2", WorkerState.DRAINING)]  # fmt: skip
    assert pick_to_drain(beats, owned={"p-w0", "p-w1", "p-w2"}) == "p-w1"
    assert pick_to_drain(beats, owned=set()) is None
    assert next_worker_id("p", {"p-w0", "p-w2"}) == "p-w1"


@pytest.mark.parametrize("tick_s", [0.2, 0.5, 2.0, 10.0])
def test_a_pool_state_outlives_every_age_the_gate_counts_fresh(tick_s: float) -> None:
    disabled = PoolConfig(
        name="empty", model="sluice-empty", scaling=ScalingConfig(min_replicas=0, max_replicas=0)
    )
    lag = pool_lag("empty", "t", "g", {0: 0}, {0: None}, {}, read_at=0.0)
    state = pool_state(lag, [], now=0.0)
    ttl_s = pool_state_ttl_ms(tick_s) / 1000
    assert ttl_s >= 3 * tick_s
    for age in (0.5 * POOL_STATE_STALE_S, POOL_STATE_STALE_S):  # a round may run long past its tick
        refusal = pool_refusal(disabled, state, now=age)
        assert refusal is not None, age
        assert refusal.code == "no_workers"
        assert age < ttl_s, f"the key is gone at {age} s while its state is fresh"
    assert pool_refusal(disabled, state, now=POOL_STATE_STALE_S + 0.1) is None  # stale: nothing known, open
