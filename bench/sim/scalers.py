"""Scaling rules the fleet simulator compares, each acting through the same start-up delay.

- `sluice`: the project's scaler, unchanged: `ArrivalEstimator` (Holt) on the arrival counter,
  `ReplicaMeasures` and `pool_signals` on heartbeats (it learns the start-up from the replicas' launch and
  ready times, as from the live heartbeats' started_at and ready_at), and `policy.decide` every tick.
- `keda`: KEDA's Kafka scaler as the HPA applies it. Sources: kedacore/keda pkg/scalers/kafka_scaler.go
  (metric = consumer lag, target lagThreshold, default 10) and the Kubernetes HPA algorithm
  (desired = ceil(current x metric / target), 10% tolerance, metrics re-read every 15 s by the HPA,
  KEDA's 30 s pollingInterval governing only activation from zero; default behaviour: scale up by at most
  max(4 pods, 100%) per 15 s, scale down after a 300 s stabilisation window). For an External metric of
  type AverageValue this is desired = ceil(lag / lagThreshold).
- `reactive`: a utilisation rule in the HPA's form: desired = ceil(current x utilisation / target),
  with utilisation the requests in the system per replica over a per-replica concurrency.
- `dynamo-planner`: NVIDIA Dynamo's planner in throughput mode. Source: ai-dynamo/dynamo
  docs "Planner Design": every adjustment_interval (180 s) it predicts the next interval's request rate,
  corrects the profile by prefill_correction = actual TTFT / expected TTFT over the interval (queueing
  and cache hits the profile does not know), and sets replicas = ceil(predicted rate x correction / the
  per-replica rate profiled to meet the SLO). The predictor here is `constant` (the last interval's
  rate); ARIMA and Prophet are its other choices. Its load-based mode (online regression on forward-pass
  metrics, +/-1 replica every few seconds) is not modelled.
- `llm-d-tokens`: llm-d's token-aware rule (the workload variant autoscaler's guidance): the in-flight
  prompt tokens over the calibrated prefill throughput are seconds of backlog, kept at or under the TTFT
  SLO: desired = ceil(tokens / (prefill tokens/s per replica x SLO)), applied by the HPA.
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
        """`capacity_default` and `startup_s` are the priors until replicas have been measured."""
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
                sent_at=state.now, ttl_ms=3000, waiting=r.queue, inbox_pending=0,
                completed_per_s=state.completed_recent.get(r.index, 0.0), ready_at=r.ready_at,
                started_at=r.launched_at,
            )
            for r in state.ready
        ]  # fmt: skip
        self.measures.observe(beats)
        held = state.backlog - sum(r.queue for r in state.ready)  # the hold stands for the lag
        signals = pool_signals(state.now, held, beats, state.starting, rate, trend, self.measures)
        signals = dataclasses.replace(signals, backlog=state.backlog, draining=state.draining)
        return decide(signals, self.policy, self.memory).target


class Hpa:
    """The HPA's handling of a desired count, with its default behaviour: 10% tolerance; scale up at once
    but by at most max(4 pods, 100% of current) per 15 s period; scale down to the highest recommendation
    of the last 300 s."""

    def __init__(self, min_replicas: int, max_replicas: int, window_s: float = 300.0) -> None:
        self.min, self.max, self.window_s = min_replicas, max_replicas, window_s
        self.history: deque[tuple[float, int]] = deque()
        self.ups: deque[tuple[float, int]] = deque()  # (time, replicas before) of recent scale-ups

    def apply(self, now: float, current: int, desired: int) -> int:
        desired = max(self.min, min(self.max, desired))
        if current and abs(desired / current - 1) <= 0.1:
            desired = current
        self.history.append((now, desired))
        while self.history and now - self.history[0][0] > self.window_s:
            self.history.popleft()
        if desired < current:
            return max(d for _, d in self.history)  # the highest recommendation of the window
        while self.ups and now - self.ups[0][0] >= 15.0:
            self.ups.popleft()
        base = self.ups[0][1] if self.ups else current  # replicas at the start of the period
        limit = max(base + 4, 2 * base)
        if desired > current:
            self.ups.append((now, current))
        return min(desired, max(current, limit))


class KedaScaler:
    name = "keda"

    def __init__(
        self, min_replicas: int, max_replicas: int, lag_threshold: int = 10, interval_s: float = 15.0
    ):
        self.interval_s = interval_s
        self.lag_threshold = lag_threshold
        self.hpa = Hpa(min_replicas, max_replicas)

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
        interval_s: float = 15.0,
    ):
        self.interval_s = interval_s
        self.concurrency = concurrency
        self.target_utilization = target
        self.hpa = Hpa(min_replicas, max_replicas)

    def target(self, state: FleetState) -> int:
        ready = max(1, len(state.ready))
        in_system = sum(r.in_system for r in state.ready) + state.backlog
        utilization = in_system / (ready * self.concurrency)
        desired = math.ceil(ready * utilization / self.target_utilization)
        return self.hpa.apply(state.now, len(state.ready) + state.starting, desired)


class DynamoPlannerScaler:
    name = "dynamo-planner"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        capacity: float,
        expected_ttft_s: float,
        interval_s: float = 180.0,
    ) -> None:
        self.min, self.max = min_replicas, max_replicas
        self.capacity = capacity  # requests/s one replica serves within the SLO, from profiling
        self.expected_ttft_s = expected_ttft_s  # the profiled TTFT at that load
        self.interval_s = interval_s
        self._last: tuple[float, int] | None = None

    def target(self, state: FleetState) -> int:
        current = len(state.ready) + state.starting
        last, self._last = self._last, (state.now, state.arrived)
        if last is None or state.now <= last[0]:
            return max(self.min, min(self.max, current))
        predicted = (state.arrived - last[1]) / (state.now - last[0])  # the constant predictor
        correction = 1.0 if math.isnan(state.ttft_mean) else state.ttft_mean / self.expected_ttft_s
        return max(self.min, min(self.max, math.ceil(predicted * correction / self.capacity)))


class LlmdTokenScaler:
    name = "llm-d-tokens"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        prefill_tokens_per_s: float,
        ttft_slo_s: float,
        interval_s: float = 15.0,
    ) -> None:
        self.interval_s = interval_s
        self.rate = prefill_tokens_per_s
        self.slo = ttft_slo_s
        self.hpa = Hpa(min_replicas, max_replicas)

    def target(self, state: FleetState) -> int:
        desired = math.ceil(state.prefill_tokens / (self.rate * self.slo))
        return self.hpa.apply(state.now, len(state.ready) + state.starting, desired)
