"""The scaler's loop, per pool and tick: measure, decide, act, export.

measure: lag from the broker (end offsets minus the dispatcher group's commits), requests held by
dispatchers and workers' heartbeats from Redis; decide: the scaling policy and the speculative-decoding
policy; act: the backend; export: metrics, the lag status and the pool state admission control reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from plumbing.health import Liveness, health_body, item_failed
from plumbing.state import read_heartbeats
from queue_schemas.codec import encode
from queue_schemas.config import PoolConfig, ScalingConfig
from queue_schemas.messages import Heartbeat, WorkerState
from queue_schemas.names import Names
from scaler import metrics
from scaler.backends import Backend, DrainAsks
from scaler.burrow import LagWindow, Status, pool_status
from scaler.dashboard import HISTORY_POINTS, Sample, sample_of, worker_row
from scaler.forecast import ArrivalEstimator
from scaler.lag import PoolLag, pool_lag, pool_state, pool_state_ttl_ms
from scaler.plan import GPUS, MODELS, Deployment, Workload, plan
from scaler.policy import (
    PoolSignals,
    ScalerMemory,
    ScalingPolicy,
    Verdict,
    decide,
    policy_from_config,
    prefill_target,
)
from scaler.signals import ReplicaMeasures, pool_signals, spec_decoding_on

log = structlog.get_logger("sluice.scaler")

SPEC_LOW_BATCH = 4.0
SPEC_HIGH_BATCH = 8.0
SCALER_LOOP = "scaler"  # the scaling loop, as /healthz names it
TICK_ITEMS = "scaler.pool_tick"  # the `loop` label of pool rounds that raised


class LagReader:
    """Lag from the broker's offsets, corrected by the high watermarks dispatchers report in Redis."""

    def __init__(
        self,
        admin: AIOKafkaAdminClient,
        consumer: AIOKafkaConsumer,
        names: Names,
        redis: aioredis.Redis | None = None,
    ) -> None:
        self._admin = admin
        self._consumer = consumer
        self.names = names
        self._redis = redis

    async def read(self, pool: str, batch: bool = False) -> PoolLag:
        """Lag of the pool's interactive requests topic, or of its batch topic (same consumer group)."""
        topic = self.names.batch_topic(pool) if batch else self.names.requests_topic(pool)
        group = self.names.dispatcher_group(pool)
        partitions = await self._partitions(topic)
        tps = [TopicPartition(topic, p) for p in partitions]
        if not tps:
            return pool_lag(pool, topic, group, {}, {}, {}, time.time())
        ends = await self._consumer.end_offsets(tps)
        starts = await self._consumer.beginning_offsets(tps)
        # Passing the partitions explicitly is required by the dev broker and harmless on Kafka.
        offsets = await self._admin.list_consumer_group_offsets(group, partitions=tps)
        committed = {
            tp.partition: (meta.offset if meta is not None else None) for tp, meta in offsets.items()
        }
        return pool_lag(
            pool,
            topic,
            group,
            {tp.partition: off for tp, off in ends.items()},
            committed,
            {tp.partition: off for tp, off in starts.items()},
            time.time(),
            await self._reported_highwater(pool, batch),
        )

    async def _reported_highwater(self, pool: str, batch: bool) -> dict[int, int]:
        if self._redis is None:
            return {}
        key = self.names.batch_highwater(pool) if batch else self.names.highwater(pool)
        raw = await self._redis.hgetall(key)
        return {int(p): int(v) for p, v in raw.items()}

    async def _partitions(self, topic: str) -> list[int]:
        described = await self._admin.describe_topics([topic])
        for entry in described:
            if entry.get("topic") == topic and not entry.get("error_code"):
                return sorted(int(p["partition"]) for p in entry.get("partitions", []))
        return []


@dataclass
class PoolReport:
    """The latest of everything the scaler knows of a pool (served as JSON and used by dashboards)."""

    lag: PoolLag
    status: Status
    partition_status: dict[int, Status]
    signals: PoolSignals
    verdict: Verdict
    held: int
    spec_decoding: bool
    workers: list[Heartbeat] = field(default_factory=list)
    batch_lag: PoolLag | None = None  # shown to people; scaling answers to interactive demand only
    migrations: dict[str, int] = field(default_factory=dict)  # lost workers' requests, by outcome
    handoffs: dict[str, int] = field(default_factory=dict)  # loaded, fallback, wait_ms (names.handoff_totals)

    @property
    def completion_rate(self) -> float:
        """Requests per second the pool's workers finish, as their heartbeats report it."""
        return sum(hb.completed_per_s for hb in self.workers)


@dataclass
class PoolController:
    config: PoolConfig
    policy: ScalingPolicy
    estimator: ArrivalEstimator = field(default_factory=ArrivalEstimator)
    memory: ScalerMemory = field(default_factory=ScalerMemory)
    window: LagWindow = field(default_factory=LagWindow)
    running_window: deque[float] = field(default_factory=lambda: deque(maxlen=30))
    spec_on: bool = False
    measures: ReplicaMeasures | None = None

    def __post_init__(self) -> None:
        scaling = self.config.scaling
        self.measures = ReplicaMeasures(capacity_default(scaling), scaling.startup_s)
        self.spec_on = scaling.spec_decoding == "on"


def capacity_default(scaling: ScalingConfig) -> float:
    """Requests per second per replica until measured: from `sluice plan` when a model preset is named."""
    if scaling.plan_model is None:
        return scaling.requests_per_replica_s
    if scaling.plan_model not in MODELS or scaling.plan_gpu not in GPUS:
        raise ValueError(f"unknown plan preset {scaling.plan_model!r} on {scaling.plan_gpu!r}")
    deployment = Deployment(tensor_parallel=scaling.plan_tensor_parallel)
    return plan(
        MODELS[scaling.plan_model], GPUS[scaling.plan_gpu], Workload(), deployment
    ).requests_per_s_per_replica


def controllers(pools: list[PoolConfig]) -> dict[str, PoolController]:
    """One controller per pool; a scaling section that is not a valid policy stops the scaler at start."""
    out = {}
    for pool in pools:
        try:
            out[pool.name] = PoolController(pool, policy_from_config(pool.scaling))
        except ValueError as exc:
            raise ValueError(f"pool {pool.name}: {exc}") from None
    return out


MAX_RETRY_DELAY_S = 30.0
DRAIN_REQUEST_TTL_S = 120  # a drain request the scaler stops renewing lapses, and the worker is ready again


def retry_delay(tick_s: float, failures: int) -> float:
    """The pause before the next round: the tick, doubled per failed round in a row, capped."""
    return float(min(tick_s * 2.0 ** min(failures, 16), max(tick_s, MAX_RETRY_DELAY_S)))


def _counts(raw: dict[Any, Any]) -> dict[str, int]:
    return {k.decode() if isinstance(k, bytes) else str(k): int(v) for k, v in raw.items()}


class Scaler:
    def __init__(
        self,
        reader: LagReader,
        redis: aioredis.Redis,
        backend: Backend,
        pools: dict[str, PoolController],
        tick_s: float,
    ) -> None:
        self.reader = reader
        self.redis = redis
        self.names = reader.names
        self.backend = backend
        self.pools = pools
        self.tick_s = tick_s
        self.reports: dict[str, PoolReport] = {}
        self.history: dict[str, deque[Sample]] = {}
        self._exported_workers: dict[str, set[str]] = {}
        self.last_round_ok = time.monotonic()  # grace from the start: the first round has not run yet

    async def run(self) -> None:
        """Tick every pool, forever. A failing tick (the bus, the cluster's API, a bug) is logged and the
        next round comes after a backoff; `healthy` says whether a whole round has succeeded lately."""
        failures = 0
        while True:
            ok = True
            for name in self.pools:
                try:
                    await self.tick(name)
                except (KafkaError, RedisError) as exc:
                    ok = False
                    log.warning("pool tick failed", pool=name, error=str(exc))
                except Exception as exc:  # this pool's round alone: the other pools are ticked
                    ok = False
                    item_failed(TICK_ITEMS)
                    log.error("pool tick failed", pool=name, error=type(exc).__name__, exc_info=True)
            if ok:
                self.last_round_ok = time.monotonic()
            failures = 0 if ok else failures + 1
            await asyncio.sleep(retry_delay(self.tick_s, failures))

    async def _send_drain_asks(self, asks: DrainAsks) -> None:
        for worker_id in asks.drain:  # refreshed every tick it still stands, so a lost scaler's lapse
            await self.redis.set(self.names.drain_request(worker_id), b"1", ex=DRAIN_REQUEST_TTL_S)
        if asks.withdraw:
            await self.redis.delete(*(self.names.drain_request(w) for w in asks.withdraw))

    def healthy(self, stale_s: float, now: float) -> bool:
        """Whether a round over every pool succeeded within the last `stale_s` seconds."""
        return now - self.last_round_ok <= stale_s

    def health(self, liveness: Liveness, stale_s: float, now: float) -> tuple[int, dict[str, Any]]:
        """/healthz: 503 while the loop's task is dead (`liveness`) or no round succeeded lately."""
        rounds_ok = self.healthy(stale_s, now)
        code, body = health_body(liveness, extra=[("scaling_rounds", rounds_ok)])
        if not rounds_ok:
            body["detail"] = "no scaling round succeeded lately"
        return code, body

    async def tick(self, name: str) -> PoolReport:
        c = self.pools[name]
        assert c.measures is not None
        # measure
        lag = await self.reader.read(name)
        batch_lag = await self._batch_lag(name)
        every, _ = await read_heartbeats(self.redis, self.names, name)
        beats = [hb for hb in every if hb.role != "prefill"]  # sized from lag; prefill workers follow them
        held, dispatchers = await self._held(name)
        now = time.time()
        for partition, value in lag.partitions.items():
            c.window.record(now, partition, lag.committed.get(partition, 0), value)
        statuses = c.window.statuses(has_consumers=dispatchers > 0)
        if lag.partitions:  # no partitions read: the counter is unknown this tick, not zero
            c.estimator.observe(now, lag.end_total)
        rate, trend = c.estimator.rate, c.estimator.trend
        c.measures.observe(beats)
        launching = self.backend.launching(name, {hb.worker_id for hb in beats})
        signals = pool_signals(now, lag.total, beats, launching, rate, trend, c.measures)
        # decide
        verdict = decide(signals, c.policy, c.memory)
        ready = [hb for hb in beats if hb.state == "ready"]
        if ready:
            c.running_window.append(sum(hb.running for hb in ready) / len(ready))
        mode = c.config.scaling.spec_decoding
        c.spec_on = spec_decoding_on(mode, list(c.running_window), c.spec_on, SPEC_LOW_BATCH, SPEC_HIGH_BATCH)
        # act
        asks = await asyncio.to_thread(self.backend.apply, name, verdict, beats, c.spec_on)
        await self._send_drain_asks(asks)
        group = c.config.scaling.prefill
        if group is not None:
            prefill = [hb for hb in every if hb.role == "prefill" and hb.state is not WorkerState.FAILED]
            target = prefill_target(group, verdict.target)
            await asyncio.to_thread(self.backend.size_prefill, name, target, prefill)
        if verdict.action != "hold":
            log.info(
                "scaling", pool=name, action=verdict.action, target=verdict.target, reason=verdict.reason
            )
        # export
        moves = await self.redis.hgetall(self.names.migrations(name))
        handoffs = await self.redis.hgetall(self.names.handoff_totals(name))
        report = PoolReport(
            lag, pool_status(statuses), statuses, signals, verdict, held, c.spec_on, every, batch_lag,
            _counts(moves), _counts(handoffs),
        )  # fmt: skip
        self.reports[name] = report
        self.history.setdefault(name, deque(maxlen=HISTORY_POINTS)).append(sample_of(report, now))
        self._export(name, report, c)
        state = pool_state(lag, beats, now, held)
        await self.redis.set(self.names.pool_state(name), encode(state), px=pool_state_ttl_ms(self.tick_s))
        return report

    async def _batch_lag(self, pool: str) -> PoolLag | None:
        """The batch topic's lag; None (and the tick goes on) when it cannot be read."""
        try:
            return await self.reader.read(pool, batch=True)
        except KafkaError as exc:
            log.warning("batch lag not read", pool=pool, error=str(exc))
            return None

    async def _held(self, pool: str) -> tuple[int, int]:
        """(requests held, live dispatchers) from the keys each dispatcher refreshes every second."""
        keys = [k async for k in self.redis.scan_iter(match=self.names.held(pool, "*"), count=100)]
        if not keys:
            return 0, 0
        values = await self.redis.mget(keys)
        return sum(int(v) for v in values if v is not None), sum(1 for v in values if v is not None)

    def _export(self, pool: str, r: PoolReport, c: PoolController) -> None:
        for partition, value in r.lag.partitions.items():
            metrics.PARTITION_LAG.labels(pool, str(partition)).set(value)
        metrics.POOL_LAG.labels(pool).set(r.lag.total)
        if r.batch_lag is not None:
            metrics.BATCH_LAG.labels(pool).set(r.batch_lag.total)
        metrics.LAG_READ_AT.labels(pool).set(r.lag.read_at)
        for status in Status:
            metrics.LAG_STATUS.labels(pool, status.value).set(1 if status is r.status else 0)
        metrics.HELD.labels(pool).set(r.held)
        metrics.BACKLOG.labels(pool).set(r.signals.backlog)
        metrics.ARRIVAL.labels(pool).set(r.signals.arrival_rate)
        metrics.FORECAST.labels(pool).set(r.verdict.forecast)
        metrics.CAPACITY.labels(pool).set(r.signals.capacity_per_replica)
        metrics.STARTUP.labels(pool).set(r.signals.startup_s)
        for state, count in (
            ("ready", r.signals.ready),
            ("starting", r.signals.starting),
            ("draining", r.signals.draining),
            ("desired", r.verdict.desired),
        ):
            metrics.REPLICAS.labels(pool, state).set(count)
        metrics.DECISIONS.labels(pool, r.verdict.action).inc()
        metrics.SPEC_DECODING.labels(pool).set(1 if c.spec_on else 0)
        self._export_workers(pool, r.workers)

    def _export_workers(self, pool: str, beats: list[Heartbeat]) -> None:
        """Per-worker gauges from heartbeats; a worker that stopped beating loses its series."""
        now = time.time()
        current = set()
        for hb in beats:
            row = worker_row(hb, now)
            current.add(hb.worker_id)
            metrics.WORKER_RUNNING.labels(pool, hb.worker_id).set(row["running"])
            metrics.WORKER_WAITING.labels(pool, hb.worker_id).set(row["waiting"])
            metrics.WORKER_PREEMPTIONS.labels(pool, hb.worker_id).set(hb.preemptions)
            for gauge, value in (
                (metrics.WORKER_KV_USED, row["kv_used"]),
                (metrics.WORKER_PREFIX_HIT, row["prefix_hit"]),
            ):
                gauge.labels(pool, hb.worker_id).set(value if value is not None else 0.0)
        for gone in self._exported_workers.get(pool, set()) - current:
            for gauge in metrics.WORKER_GAUGES:
                with contextlib.suppress(KeyError):
                    gauge.remove(pool, gone)
        self._exported_workers[pool] = current
