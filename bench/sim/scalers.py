"""Scaling rules the fleet simulator compares, each acting through the same start-up delay.

- `sluice`: the project's scaler, unchanged: `ArrivalEstimator` (a line over 300 s) on the arrival counter,
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
  than a prefill and a decode count: 0.8.1's throughput planner scales disaggregated pools only, and
  1.0.1 refuses throughput scaling for an aggregated pool (see `dynamo-planner-agg`), so this row is
  the throughput rule carried over to aggregated replicas. Its users set TTFT and ITL targets (defaults
  500 ms and 50 ms) and its profiler measures the throughput per GPU that meets them, so that rate is
  the knob swept: on this replica model (decode step 15 ms + 0.15 ms per sequence, 350 uncached prompt
  tokens and 250 output tokens a request) the 64 slots bind before a 50 ms ITL does, at about 8
  requests/s; ITL targets of about 20.5 and 18.6 ms give 6 and 4.5. Not modelled: the decode-side
  correction (0.8.1 divides the ITL target by observed / profiled ITL, which can raise the count),
  demand counted in prompt and output tokens rather than requests, and its load-based mode (off by
  default for disaggregated pools).
- `dynamo-planner-agg`: Dynamo 1.0.1's planner for an aggregated pool, load-based (its only mode there):
  one replica more or fewer every 5 s from linear fits of TTFT and ITL against each replica's load,
  and no decision while a replica starts (`DynamoAggPlannerScaler` gives the sources).
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
from bench.sim.routers import heartbeat
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
            heartbeat(r, state.now, 1).model_copy(
                update={
                    "completed_per_s": state.completed_recent.get(r.index, 0.0),
                    "ready_at": r.ready_at,
                    "started_at": r.launched_at,
                }
            )
            for r in state.ready
        ]
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


@dataclasses.dataclass(frozen=True)
class WorkerLoad:
    """One replica's figures in one sample of Dynamo's router metrics (the agg planner's input). A
    latency gauge is None until the router has set it for that worker."""

    prefill_tokens: float  # active prefill tokens (see DynamoAggPlannerScaler)
    decode_blocks: float  # active decode blocks (see DynamoAggPlannerScaler)
    isl: float | None = None  # the last request to reach its first token here: its prompt tokens
    ttft_s: float | None = None  # and its time to first token
    itl_s: float | None = None  # the mean inter-token latency of the last request to finish here


def sla_load(points: list[tuple[float, float]], target: float, min_points: int = 5) -> float | None:
    """The load x at which a least-squares line through (x, latency) points reaches `target`, as
    Dynamo's `LoadBasedRegressionModel.predict_x_from_sla` solves it: None under `min_points`; with a
    slope not above 0, the smallest x observed under the target (the smallest x of all when none is)."""
    if len(points) < min_points:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    try:
        slope, intercept = statistics.linear_regression(xs, ys)
    except statistics.StatisticsError:  # every x equal: no slope
        slope, intercept = 0.0, 0.0
    if slope <= 0:
        below = [x for x, y in points if y < target]
        return max(0.0, min(below) if below else min(xs))
    return max(0.0, (target - intercept) / slope)


def agg_planner_step(
    current: int,
    recent: list[WorkerLoad],
    prefill_sla_load: float | None,
    mean_isl: float,
    decode_sla_load: float | None,
    down_sensitivity: float = 0.8,
) -> int:
    """Dynamo's aggregated planner decision from the latest sample of each ready replica: one more when
    every replica is past either target, one fewer when every replica is under both scale-down
    boundaries (the target x (n - 1) / n x sensitivity), else no change. A target it cannot compute
    (too few observations, or an SLA not reachable at the mean prompt) leaves that side undecided."""
    n = len(recent)
    if not n:
        return current
    sides: list[str | None] = []
    prefill_target = None if prefill_sla_load is None else prefill_sla_load - mean_isl
    for target, load in (
        (prefill_target, [w.prefill_tokens for w in recent]),
        (decode_sla_load, [w.decode_blocks for w in recent]),
    ):
        if target is None or target <= 0:
            sides.append(None)
        elif all(x > target for x in load):
            sides.append("up")
        elif n > 1 and all(x < target * (n - 1) / n * down_sensitivity for x in load):
            sides.append("down")
        else:
            sides.append(None)
    if "up" in sides:
        return current + 1
    if sides == ["down", "down"]:
        return current - 1
    return current


def averaged(loads: list[WorkerLoad]) -> WorkerLoad:
    """A replica's figures averaged over the samples it appears in, each gauge over the samples that
    have it (the planner's per-worker average)."""

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.fmean(present) if present else None

    return WorkerLoad(
        statistics.fmean(w.prefill_tokens for w in loads),
        statistics.fmean(w.decode_blocks for w in loads),
        mean([w.isl for w in loads]),
        mean([w.ttft_s for w in loads]),
        mean([w.itl_s for w in loads]),
    )


class DynamoAggPlannerScaler:
    """Dynamo's planner for an aggregated pool (`mode: agg`), whose only mode is load-based. Sources:
    ai-dynamo/dynamo `components/src/dynamo/planner` at 1.0.1 (`utils/agg_planner.py`,
    `utils/load_based_regression.py`, `utils/prometheus.py`, `defaults.py`, `kube.py`,
    `kubernetes_connector.py`).

    The router's per-worker metrics are sampled 10 times per `load_adjustment_interval` (5 s), the
    last 10 kept. Every interval each replica's averages add one observation to two sliding linear fits
    of 50 points (`load_learning_window`; 5 before the first decision): TTFT against active prefill
    tokens + the last prompt, and ITL against active decode blocks. The TTFT target (500 ms) and ITL
    target (50 ms) read back through the fits give the load a replica may carry, and `agg_planner_step`
    moves the count by one (scale-down sensitivity 80%). A change is applied with `blocking=True`: the
    planner then checks every 10 s whether the deployment is ready (a replica started counts once it
    is), and its loop sleeps 5 s before the next decision. There is no replica cap here beyond the
    shared 64 (upstream's is `max_gpu_budget`, 8 GPUs by default). Not modelled: a replica retired in
    the last 5 s adds no observation (upstream's averages include every worker in the sample buffer),
    and the decision upstream skips when the deployment's ready count differs from the router's.

    How the simulated figures stand for the router's:
    - TTFT and prompt length are set when a request's first token comes, ITL when it finishes (the
      router updates ITL as tokens stream);
    - active prefill tokens are the replica's prompt tokens not yet prefilled (a waiting request's whole
      prompt, where Dynamo's router counts the tokens its index did not match at routing: more than
      the router counts on a busy replica, as in the `dynamo` router here) plus an even share of the
      prompt tokens the fleet holds (the scaling runs use sluice's dispatcher, which holds what the
      replicas cannot queue; Dynamo's frontend would have routed them at once);
    - active decode blocks are the uncached prompt blocks of the sequences decoding (Dynamo's router
      counts every routed request's prompt blocks, shared ones once): fewer than the router counts, so
      this side asks for replicas later. At 64 sequences a step takes about 25 ms, so the 50 ms target
      rarely binds."""

    name = "dynamo-planner-agg"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        ttft_s: float = 0.5,
        itl_s: float = 0.05,
        every_s: float = 5.0,
        samples: int = 10,
        window: int = 50,
        min_points: int = 5,
        poll_s: float = 10.0,
    ) -> None:
        self.min, self.max = min_replicas, max_replicas
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.every_s, self.samples, self.poll_s = every_s, samples, poll_s
        self.interval_s = every_s / samples
        self.buffer: deque[dict[int, WorkerLoad]] = deque(maxlen=samples)
        self.ttft_points: deque[tuple[float, float]] = deque(maxlen=window)
        self.itl_points: deque[tuple[float, float]] = deque(maxlen=window)
        self.min_points = min_points
        self.decide_at = every_s - self.interval_s / 2  # the loop's first wake, as a tick sees it
        self.poll_at: float | None = None  # while it waits for the deployment to be ready

    def target(self, state: FleetState) -> int:
        current = len(state.ready) + state.starting
        prefill = {r.index: r.prefill_tokens() for r in state.ready}
        held_share = max(0, state.prefill_tokens - sum(prefill.values())) / max(1, len(prefill))
        sample: dict[int, WorkerLoad] = {}
        for r in state.ready:
            first = state.first_tokens.get(r.index)
            sample[r.index] = WorkerLoad(
                prefill[r.index] + held_share,
                float(r.running_blocks),
                None if first is None else float(first[0]),
                None if first is None else first[1],
                state.itls.get(r.index),
            )
        self.buffer.append(sample)
        if self.poll_at is not None:
            while self.poll_at <= state.now:
                if state.starting:
                    self.poll_at += self.poll_s
                    continue
                self.decide_at, self.poll_at = self.poll_at + self.every_s, None
                break
            return current
        if state.now < self.decide_at:
            return current
        self.decide_at += self.every_s
        for index in sample:
            mean = averaged([s[index] for s in self.buffer if index in s])
            if mean.ttft_s and mean.isl:
                self.ttft_points.append((mean.prefill_tokens + mean.isl, mean.ttft_s))
            if mean.itl_s and mean.decode_blocks > 0:
                self.itl_points.append((mean.decode_blocks, mean.itl_s))
        isls = [w.isl for s in self.buffer for w in s.values() if w.isl is not None]
        step = agg_planner_step(
            current,
            list(sample.values()),
            sla_load(list(self.ttft_points), self.ttft_s, self.min_points),
            statistics.fmean(isls) if isls else 0.0,
            sla_load(list(self.itl_points), self.itl_s, self.min_points),
        )
        if step != current:  # it asks for the count, clamped or not, and waits for the deployment
            self.poll_at = state.now + self.poll_s
        return max(self.min, min(self.max, step))


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
