"""The columnar placement (live path) decides as the reference placement function does."""

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.placement import (
    AFFINITY_REASON,
    SHED_REASON,
    SLO_REASON,
    Demand,
    PlacementPolicy,
    WorkerSnapshot,
    blocks_needed,
    choose,
    predicted_row,
    rejection,
    score,
)
from dispatcher.table import WorkerTable, choose_fast
from queue_schemas.messages import Heartbeat, Priority, WorkerState

NOW = 1000.0

worker = st.fixed_dictionaries(
    {
        "state": st.sampled_from(list(WorkerState)),
        "age": st.floats(0, 4),
        "running": st.integers(0, 40),
        "waiting": st.integers(0, 70),
        "total": st.integers(0, 2000),
        "free_share": st.floats(0, 1),
        "in_flight": st.integers(0, 10),
        "in_flight_blocks": st.integers(0, 300),
        "matched": st.integers(0, 8),
        "slots": st.integers(0, 64),
        "completed": st.floats(0, 300),
        "light": st.integers(0, 3),
        "adapter": st.booleans(),
        "backlog": st.integers(0, 20_000),
        "tokens": st.integers(0, 5_000),
        "rate": st.sampled_from([0.0, 2_000.0, 12_000.0]),
        "step": st.sampled_from([0.0, 0.02, 0.2]),
        "correction": st.floats(0.2, 5),
    }
)


def heartbeat(i: int, w: dict[str, object]) -> Heartbeat:
    total = int(w["total"])  # type: ignore[call-overload]
    return Heartbeat(
        worker_id=f"w{i}", pool="p", model="m", state=w["state"], seq=1, sent_at=NOW - float(w["age"]),  # type: ignore[arg-type]
        ttl_ms=3000, kv_blocks_total=total, kv_blocks_free=int(total * float(w["free_share"])),  # type: ignore[arg-type]
        block_size=16, running=w["running"], waiting=w["waiting"], inbox_pending=0,  # type: ignore[arg-type]
        decode_tokens_per_s=0.0, started_at=0.0, max_running=w.get("slots", 0),  # type: ignore[arg-type]
        completed_per_s=w.get("completed", 0.0), light_slots=w.get("light", 0),  # type: ignore[arg-type]
        adapters=("x",) if w.get("adapter") else (), prefill_backlog=w.get("backlog", 0),  # type: ignore[arg-type]
        prefill_tokens_per_s=w.get("rate", 0.0), step_s=w.get("step", 0.0),  # type: ignore[arg-type]
        ttft_correction=w.get("correction", 1.0),  # type: ignore[arg-type]
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(worker, min_size=1, max_size=12),
    max_tokens=st.integers(1, 600),
    batch=st.booleans(),
    seed=st.integers(0, 1000),
    depth=st.sampled_from(["derived", "fixed"]),
    light=st.booleans(),
    adapter=st.sampled_from([None, "x"]),
    objective=st.sampled_from(["latency", "score"]),
    waited=st.sampled_from([0.0, 6.0, 20.0]),
    slo=st.sampled_from([None, 0.05, 2.0]),
    sheddable=st.booleans(),
)
def test_fast_and_reference_agree(
    workers: list[dict[str, object]],
    max_tokens: int,
    batch: bool,
    seed: int,
    depth: str,
    light: bool,
    adapter: str | None,
    objective: str,
    waited: float,
    slo: float | None,
    sheddable: bool,
) -> None:
    policy = PlacementPolicy(queue_depth=depth, objective=objective)  # type: ignore[arg-type]
    priority = Priority.BATCH if batch else Priority.INTERACTIVE
    demand = Demand(
        128, [f"h{i}" for i in range(8)], max_tokens, priority, waited, light=light, adapter=adapter,
        ttft_slo_s=slo, sheddable=sheddable,
    )  # fmt: skip
    table = WorkerTable(capacity=2)
    snapshots = []
    for i, w in enumerate(workers):
        hb = heartbeat(i, w)
        table.upsert(hb, int(w["in_flight"]), int(w["in_flight_blocks"]), int(w["tokens"]))  # type: ignore[call-overload]
        snapshots.append(WorkerSnapshot(hb, w["in_flight"], w["in_flight_blocks"], w["matched"], w["tokens"]))  # type: ignore[arg-type]
    matched = np.array([float(w["matched"]) for w in workers])  # type: ignore[arg-type]
    held = np.array([1.0 if w["adapter"] else 0.0 for w in workers])
    fast = choose_fast(table, matched, demand, NOW, policy, random.Random(seed), held)
    reference = choose(snapshots, demand, NOW, policy, random.Random(seed))
    assert (fast.worker_id is None) == (reference.worker_id is None)
    if fast.worker_id is None:
        waits = {AFFINITY_REASON, SLO_REASON, SHED_REASON}  # (among the filters' reasons, a tie may differ)
        assert fast.refused == reference.refused
        assert (fast.reason in waits) == (reference.reason in waits)
        assert fast.reason == reference.reason or fast.reason not in waits
        return
    if objective == "latency":
        predicted = {s.worker_id: predicted_row(s, demand, NOW, policy) for s in snapshots}
        cost = {w: p[0] + policy.stall_weight * p[4] for w, p in predicted.items()}
        assert abs(cost[fast.worker_id] - cost[str(reference.worker_id)]) < 1e-6
        assert abs(fast.predicted_ttft_s - predicted[fast.worker_id][1]) < 1e-6
        assert fast.uncached_tokens == reference.uncached_tokens or fast.worker_id != reference.worker_id
        return
    fit = [s for s in snapshots if rejection(s, demand, NOW, policy) is None]
    queues = [s.queue for s in fit]
    scores = {s.worker_id: score(s, demand, min(queues), max(queues), policy) for s in fit}
    assert abs(scores[fast.worker_id] - max(scores.values())) < 1e-9
    chosen = next(s for s in snapshots if s.worker_id == fast.worker_id)
    needed = blocks_needed(demand, chosen.matched_blocks, 16, policy)
    assert (fast.matched_blocks, fast.blocks_needed) == (chosen.matched_blocks, needed)


def test_rows_move_when_a_worker_leaves() -> None:
    table = WorkerTable(capacity=1)
    for i in range(3):
        table.upsert(heartbeat(i, {"state": WorkerState.READY, "age": 0, "running": i, "waiting": 0,
                                   "total": 100, "free_share": 1.0}), 0, 0)  # fmt: skip
    table.remove("w0")
    assert sorted(table.ids) == ["w1", "w2"]
    assert {table.ids[r]: table.col("running")[r] for r in range(2)} == {"w1": 1.0, "w2": 2.0}
    table.add_in_flight("w2", 5)
    assert table.col("blocks")[table.row["w2"]] == 5
