"""Scaling rules the fleet simulator compares, each acting through the same start-up delay.

- `sluice`: the project's scaler, unchanged: `ArrivalEstimator` (Holt) on the arrival counter,
  `ReplicaMeasures` and `pool_signals` on heartbeats, and `policy.decide` every tick.
- `keda`: KEDA's Kafka scaler as the HPA applies it: replicas = ceil(lag / lagThreshold), polled every
  30 s, scale-down stabilised over 300 s (the HPA default), 10% tolerance.
- `reactive`: a utilisation rule in the HPA's form: replicas = ceil(current x utilisation / target),
  with utilisation the requests in the system per replica over a per-replica concurrency.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from bench.sim.fleet import FleetState
from queue_schemas.messages import Heartbeat, WorkerState
from scaler.forecast import ArrivalEstimator
from scaler.policy import ScalerMemory, ScalingPolicy, decide
from scaler.signals import ReplicaMeasures, pool_signals


class SluiceScaler:
    name = "sluice"

    def __init__(
        self, policy: ScalingPolicy, capacity_default: float, startup_s: float, interval_s: float = 5.0
    ):
        self.policy = policy
        self.interval_s = interval_s
        self.arrivals = ArrivalEstimator()
        self.measures = ReplicaMeasures(capacity_default, startup_s)
        self.memory = ScalerMemory()

    def target(self, state: FleetState) -> int:
        rate, trend = self.arrivals.observe(state.now, state.arrived)
        beats = [
            Heartbeat.model_construct(
                worker_id=f"r{r.index}", pool="sim", model="m", state=WorkerState.READY, seq=1,
                sent_at=state.now, ttl_ms=3000, waiting=len(r.waiting), inbox_pending=0,
                completed_per_s=state.completed_recent.get(r.index, 0.0), ready_at=r.ready_at,
                started_at=r.ready_at - self.measures.startup.value,
            )
            for r in state.ready
        ]  # fmt: skip
        self.measures.observe(beats)
        held = state.backlog - sum(len(r.waiting) for r in state.ready)  # the hold stands for the lag
        signals = pool_signals(state.now, held, beats, state.starting, rate, trend, self.measures)
        signals = dataclasses.replace(signals, backlog=state.backlog, draining=state.draining)
        return decide(signals, self.policy, self.memory).target


class _Hpa:
    """The HPA's handling of a desired count: 10% tolerance, instant scale-up, 300 s down stabilisation."""

    def __init__(self, min_replicas: int, max_replicas: int, window_s: float = 300.0) -> None:
        self.min, self.max, self.window_s = min_replicas, max_replicas, window_s
        self.history: deque[tuple[float, int]] = deque()

    def apply(self, now: float, current: int, desired: int) -> int:
        desired = max(self.min, min(self.max, desired))
        if current and abs(desired / current - 1) <= 0.1:
            desired = current
        self.history.append((now, desired))
        while self.history and now - self.history[0][0] > self.window_s:
            self.history.popleft()
        if desired < current:
            return max(d for _, d in self.history)  # the highest recommendation of the window
        return desired


class KedaScaler:
    name = "keda"

    def __init__(
        self, min_replicas: int, max_replicas: int, lag_threshold: int = 10, interval_s: float = 30.0
    ):
        self.interval_s = interval_s
        self.lag_threshold = lag_threshold
        self.hpa = _Hpa(min_replicas, max_replicas)

    def target(self, state: FleetState) -> int:
        current = len(state.ready) + state.starting
        desired = math.ceil(state.backlog / self.lag_threshold)
        return self.hpa.apply(state.now, current, desired)


class ReactiveScaler:
    name = "reactive"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        concurrency: int,
        target: float = 0.7,
        interval_s: float = 30.0,
    ):
        self.interval_s = interval_s
        self.concurrency = concurrency
        self.target_utilization = target
        self.hpa = _Hpa(min_replicas, max_replicas)

    def target(self, state: FleetState) -> int:
        ready = max(1, len(state.ready))
        in_system = sum(r.in_system for r in state.ready) + state.backlog
        utilization = in_system / (ready * self.concurrency)
        desired = math.ceil(ready * utilization / self.target_utilization)
        return self.hpa.apply(state.now, len(state.ready) + state.starting, desired)
