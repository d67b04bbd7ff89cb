"""What the scaler measures of a pool, turned into PoolSignals for the policy. Pure.

Per-replica capacity and start-up time start from the pool file's figures and follow what the workers
report: completions per second of replicas that were saturated (work waits for them and their slots or
their KV are full: a replica with a request waiting behind a prefill, slots free, completes what it is
given, not what it can do) and ready for a minute at least (so a new replica's first, partial window
does not count), and the time from a worker's process start to its first `ready` heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence

from queue_schemas.messages import Heartbeat, WorkerState
from scaler.policy import PoolSignals

# A replica's completion rate is counted over a window (10 s in the worker) and its first requests take a
# while to finish; a replica ready for less than this would report a fraction of what it can do.
CAPACITY_SETTLE_S = 60.0
# KV this close to full stops a replica admitting more requests (vLLM keeps a few blocks for growth).
KV_FULL_SHARE = 0.05


class Ewma:
    def __init__(self, initial: float, weight: float = 0.2) -> None:
        self.value = initial
        self.weight = weight
        self.samples = 0

    def add(self, sample: float) -> float:
        self.value = sample if self.samples == 0 else self.weight * sample + (1 - self.weight) * self.value
        self.samples += 1
        return self.value


class ReplicaMeasures:
    def __init__(self, capacity_default: float, startup_default: float) -> None:
        self.capacity = Ewma(capacity_default)
        self.startup = Ewma(startup_default)
        self._started_seen: set[tuple[str, float]] = set()

    def observe(self, beats: Sequence[Heartbeat]) -> None:
        for hb in beats:
            if hb.state is WorkerState.READY and hb.ready_at is not None:
                key = (hb.worker_id, hb.started_at)
                if key not in self._started_seen:
                    self._started_seen.add(key)
                    self.startup.add(max(0.0, hb.ready_at - hb.started_at))
            settled = hb.ready_at is not None and hb.sent_at - hb.ready_at >= CAPACITY_SETTLE_S
            if hb.state is WorkerState.READY and saturated(hb) and settled and hb.completed_per_s > 0:
                self.capacity.add(hb.completed_per_s)


def saturated(hb: Heartbeat) -> bool:
    """Work waits for the replica and its slots or its KV are full, so its completions are what it serves
    at most. The engine counts a prompt its step has not reached as waiting, so the slots taken are
    running + waiting. A worker that does not state its slots (`max_running` 0) is judged by waiting
    work alone."""
    if hb.waiting <= 0 and hb.inbox_pending <= 0:
        return False
    if hb.max_running <= 0:
        return True
    kv_full = hb.kv_blocks_total > 0 and hb.kv_blocks_free <= KV_FULL_SHARE * hb.kv_blocks_total
    return hb.running + hb.waiting >= hb.max_running or kv_full


def pool_signals(
    now: float,
    lag: int,
    beats: Sequence[Heartbeat],
    launching: int,
    arrival_rate: float,
    arrival_trend: float,
    measures: ReplicaMeasures,
) -> PoolSignals:
    """`launching`: replicas started by the backend that have not sent a heartbeat yet."""
    fresh = [hb for hb in beats if now - hb.sent_at <= hb.ttl_ms / 1000]
    by_state = {state: sum(1 for hb in fresh if hb.state is state) for state in WorkerState}
    return PoolSignals(
        now=now,
        # Held requests are not committed, so the lag already counts them; placed ones waiting in an
        # inbox are committed and are not in the lag any more.
        backlog=lag + sum(hb.inbox_pending for hb in fresh),
        arrival_rate=arrival_rate,
        arrival_trend=arrival_trend,
        ready=by_state[WorkerState.READY],
        starting=by_state[WorkerState.STARTING] + launching,
        draining=by_state[WorkerState.DRAINING],
        capacity_per_replica=measures.capacity.value,
        startup_s=measures.startup.value,
    )


def spec_decoding_on(
    mode: str, running_per_replica: Sequence[float], now_on: bool, low: float, high: float
) -> bool:
    """Speculative decoding for new replicas: on while the running batch per replica stays small.

    Hysteresis: `auto` turns it on only at or below `low` and off only at or above `high`.
    """
    if mode in ("on", "off"):
        return mode == "on"
    if not running_per_replica:
        return now_on
    average = sum(running_per_replica) / len(running_per_replica)
    if now_on:
        return average < high
    return average <= low
