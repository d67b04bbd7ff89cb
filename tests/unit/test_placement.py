import random

from dispatcher.placement import WorkerSnapshot, is_eligible, least_loaded
from queue_schemas.messages import Heartbeat, WorkerState

NOW = 1000.0


def beat(
    worker_id: str, *, running: int = 0, state: WorkerState = WorkerState.READY, age: float = 0.1
) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, pool="sim", model="m", state=state, seq=1, sent_at=NOW - age, ttl_ms=3000,
        kv_blocks_total=100, kv_blocks_free=100, block_size=16, running=running, waiting=0, inbox_pending=0,
        decode_tokens_per_s=0.0, started_at=0.0,
    )  # fmt: skip


def test_picks_the_least_loaded_ready_worker() -> None:
    workers = [WorkerSnapshot(beat("a", running=3)), WorkerSnapshot(beat("b", running=1))]
    assert least_loaded(workers, NOW, random.Random(0)) == "b"


def test_in_flight_placements_count_as_load() -> None:
    workers = [WorkerSnapshot(beat("a"), in_flight=2), WorkerSnapshot(beat("b", running=1))]
    assert least_loaded(workers, NOW, random.Random(0)) == "b"


def test_stale_starting_and_draining_workers_are_skipped() -> None:
    workers = [
        WorkerSnapshot(beat("stale", age=3.5)),
        WorkerSnapshot(beat("starting", state=WorkerState.STARTING)),
        WorkerSnapshot(beat("draining", state=WorkerState.DRAINING)),
    ]
    assert not any(is_eligible(w, NOW) for w in workers)
    assert least_loaded(workers, NOW, random.Random(0)) is None


def test_ties_are_broken_at_random() -> None:
    workers = [WorkerSnapshot(beat(w)) for w in "abc"]
    rng = random.Random(1)
    chosen = {least_loaded(workers, NOW, rng) for _ in range(60)}
    assert chosen == {"a", "b", "c"}
