"""Scaling rules the fleet simulator compares, each acting through the same start-up delay.

- `sluice`: the project's scaler, unchanged: `ArrivalEstimator` (Holt) on the arrival counter,
  `ReplicaMeasures` and `pool_signals` on heartbeats (it learns the start-up from the replicas' launch and
  ready times, as from the live heartbeats' started_at and ready_at), and `policy.decide` every tick.
- `keda`: KEDA's Kafka scaler as the HPA applies it. Sources: kedacore/keda pkg/scalers/kafka_scaler.go
  (metric = the consumer group's lag, target lagThreshold, default 10, activation 0: the dispatcher
  commits a partition up to its oldest record not yet placed, so the lag is every request that arrived
  since the oldest one it holds, counted as one partition, which is the most it can be; requests that
  were placed are not lag once nothing older is held) and the Kubernetes HPA algorithm
  (desired = ceil(current x metric / target), 10% tolerance, metrics re-read every 15 s by the HPA,
  KEDA's 30 s pollingInterval governing only activation from zero; default behaviour: scale up by at most
  max(4 pods, 100%) per 15 s, scale down after a 300 s stabilisation window, then by up to 100% per
  15 s: kubernetes pkg/apis/autoscaling/v2/defaults.go). For an External metric of type AverageValue this
  is desired = ceil(lag / lagThreshold). With `allowIdleConsumers=false` KEDA caps replicas at the
  topic's partitions; the replicas scaled here are engines, not the topic's consumers, so no cap applies.
- `reactive`: a utilisation rule in the HPA's form: desired = ceil(current x utilisation / target),
  with utilisation the requests in the system per replica over a per-replica concurrency.
- `dynamo-planner`: NVIDIA Dynamo's planner in throughput mode. Sources: ai-dynamo/dynamo
  `components/src/dynamo/planner` (`defaults.py`, `utils/planner_core.py`, `utils/load_predictor.py`;
  the `ai-dynamo` 0.8.1 wheel). Every adjustment interval (180 s) it predicts the next interval's
  request count with its default predictor, ARIMA (pmdarima's `auto_arima` over the last 50 intervals;
  the last value with fewer than 5, the constant for a constant series; here `ArimaPredictor`), and sets
  replicas = ceil(predicted rate x min(1, observed TTFT / profiled TTFT) / the per-replica rate
  profiled to meet the SLO): the correction can only lower the count (0.8.1; 1.0.1 turns corrections
  off by default: `correction=False`). The count is set directly, up or down by any number at once.
  The sim's replicas serve prefill and decode together, so the profile is one rate per replica rather
  than a prefill and a decode count. Its users set TTFT and ITL targets (defaults 500 ms and 50 ms) and
  its profiler measures the throughput per GPU that meets them, so that rate is the knob swept: on this
  replica model (decode step 15 ms + 0.15 ms per sequence, 350 uncached prompt tokens and 250 output
  tokens a request) the 64 slots bind before a 50 ms ITL does, at about 8 requests/s; ITL targets of
  about 20.5 and 18.6 ms give 6 and 4.5. Not modelled: the decode-side correction (0.8.1 divides the
  ITL target by observed / profiled ITL, which can raise the count), demand counted in prompt and
  output tokens rather than requests, and its load-based mode (off by default).
- `llm-d-wva`: llm-d's workload-variant-autoscaler, saturation mode. Sources:
  llm-d-incubation/workload-variant-autoscaler `docs/saturation-analyzer.md` and
  `internal/saturation/analyzer.go` (HEAD of 2026-02). Every 60 s (`GLOBAL_OPT_INTERVAL`) it reads each
  replica's KV usage and waiting queue (their maximum over the last minute). A replica is saturated at KV
  >= 0.8 or queue >= 5; over the others it averages spare KV (0.8 - KV) and spare queue (5 - queue). It adds
  one replica when the average spare KV < 0.1 or spare queue < 3 (and none is still starting), and removes
  one when at least two replicas are unsaturated and their load spread over one fewer still leaves spare
  KV >= 0.1 and spare queue >= 3.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import deque

import numpy as np

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
            # The highest recommendation of the window, never above the current count: a scale-down
            # that the window holds back keeps what there is (and may then remove 100% per 15 s).
            return min(current, max(d for _, d in self.history))
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
        desired = math.ceil(state.lag / self.lag_threshold)
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


class ArimaPredictor:
    """The next value of a series, as Dynamo's ARIMA load predictor gives it, with a smaller search than
    pmdarima's `auto_arima`: the order of differencing d is 1 when differencing lowers the variance (pmdarima
    runs a KPSS test), then an AR(p) model, p in 0-2, is fitted by least squares to the differenced
    series and the lowest AIC kept; there are no moving-average or seasonal terms. Like Dynamo's: the
    last value while there are fewer than 5, the constant of a constant series, leading zeros skipped,
    a window of the last 50."""

    def __init__(self, window: int = 50) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if value or self.values:
            self.values.append(0.0 if math.isnan(value) else value)

    def predict(self) -> float:
        data = list(self.values)
        if len(data) < 5:
            return data[-1] if data else 0.0
        if max(data) == min(data):
            return data[-1]
        diffed = [b - a for a, b in itertools.pairwise(data)]
        d = 1 if statistics.pvariance(diffed) < statistics.pvariance(data) else 0
        series = diffed if d else data
        best: tuple[float, float] | None = None  # (AIC, forecast of the series)
        for p in range(3):
            fitted = _fit_ar(series, p)
            if fitted is not None and (best is None or fitted[0] < best[0]):
                best = fitted
        step = best[1] if best is not None else series[-1]
        return max(0.0, data[-1] + step if d else step)


def _fit_ar(series: list[float], p: int) -> tuple[float, float] | None:
    """(AIC, one-step forecast) of an AR(p) model with a constant, fitted by least squares."""
    n = len(series) - p
    if n < p + 2:
        return None
    x = np.array([[1.0, *series[t - p : t][::-1]] for t in range(p, len(series))])
    y = np.array(series[p:])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    rss = float(np.sum((y - x @ coef) ** 2))
    aic = n * math.log(max(rss, 1e-12) / n) + 2 * (p + 1)
    latest = np.array([1.0, *series[len(series) - p :][::-1]])
    return aic, float(latest @ coef)


class DynamoPlannerScaler:
    name = "dynamo-planner"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        capacity: float,
        expected_ttft_s: float,
        interval_s: float = 180.0,
        correction: bool = True,
    ) -> None:
        self.min, self.max = min_replicas, max_replicas
        self.capacity = capacity  # requests/s one replica serves within the SLO, from profiling
        self.expected_ttft_s = expected_ttft_s  # the profiled TTFT at that load
        self.interval_s = interval_s
        self.correction = correction
        self.predictor = ArimaPredictor()
        self._last: tuple[float, int] | None = None

    def target(self, state: FleetState) -> int:
        current = len(state.ready) + state.starting
        last, self._last = self._last, (state.now, state.arrived)
        if last is None or state.now <= last[0]:
            return max(self.min, min(self.max, current))
        self.predictor.add((state.arrived - last[1]) / (state.now - last[0]))
        predicted = self.predictor.predict()
        factor = 1.0
        if self.correction and not math.isnan(state.ttft_mean):
            factor = min(1.0, state.ttft_mean / self.expected_ttft_s)
        return max(self.min, min(self.max, math.ceil(predicted * factor / self.capacity)))


class LlmdWvaScaler:
    name = "llm-d-wva"

    KV_LIMIT, QUEUE_LIMIT = 0.8, 5.0
    SPARE_KV, SPARE_QUEUE = 0.1, 3.0

    def __init__(
        self, min_replicas: int, max_replicas: int, every_s: float = 60.0, interval_s: float = 5.0
    ) -> None:
        self.min, self.max = min_replicas, max_replicas
        self.every_s = every_s
        self.interval_s = interval_s  # how often the metrics are sampled for their 1-minute maximum
        self.samples: deque[tuple[float, dict[int, tuple[float, float]]]] = deque()
        self.decided_at = -math.inf

    def target(self, state: FleetState) -> int:
        current = len(state.ready) + state.starting
        now = {r.index: (1 - r.free_blocks / r.model.kv_blocks, float(r.queue)) for r in state.ready}
        self.samples.append((state.now, now))
        while self.samples and state.now - self.samples[0][0] > 60.0:
            self.samples.popleft()
        if state.now - self.decided_at < self.every_s:
            return current
        self.decided_at = state.now
        peaks = {
            index: (
                max(s[index][0] for _, s in self.samples if index in s),
                max(s[index][1] for _, s in self.samples if index in s),
            )
            for index in now
        }
        return max(self.min, min(self.max, wva_decision(current, state.starting, list(peaks.values()))))


def wva_decision(current: int, starting: int, replicas: list[tuple[float, float]]) -> int:
    """The saturation analyzer's step from each ready replica's (KV usage, waiting queue)."""
    kv_limit, queue_limit = LlmdWvaScaler.KV_LIMIT, LlmdWvaScaler.QUEUE_LIMIT
    free = [(kv, q) for kv, q in replicas if kv < kv_limit and q < queue_limit]
    if not free:
        return current + 1 if replicas and not starting else current
    spare_kv = sum(kv_limit - kv for kv, _ in free) / len(free)
    spare_q = sum(queue_limit - q for _, q in free) / len(free)
    if spare_kv < LlmdWvaScaler.SPARE_KV or spare_q < LlmdWvaScaler.SPARE_QUEUE:
        return current if starting else current + 1
    if len(free) >= 2:
        n = len(free)
        kv_after = kv_limit - sum(kv for kv, _ in free) / (n - 1)
        q_after = queue_limit - sum(q for _, q in free) / (n - 1)
        if kv_after >= LlmdWvaScaler.SPARE_KV and q_after >= LlmdWvaScaler.SPARE_QUEUE:
            return current - 1
    return current
