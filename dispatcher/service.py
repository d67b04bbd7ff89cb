"""The dispatcher loop of one pool: receive, decide, act, acknowledge.

Its partitions come from leases in Redis (dispatcher.leases), shared with the pool's other dispatchers.

- receive: records from the pool's topic go into the hold (malformed ones to the dead-letter topic);
- decide: held requests, in priority and fairness order, are offered to the placement function;
- act: one script records the placement (SET if absent, on the request id) and appends to the worker's
  inbox, so a redelivered record is recognised and not placed twice;
- acknowledge: each partition's offset is committed up to its oldest request still held.

When the hold is full the partitions are paused, so backlog stays in Kafka as lag for the scaler.

The parts live beside this module, each a class the Dispatcher is made of: dispatcher.intake (receive,
acknowledge, flow control), dispatcher.placing (decide and act), dispatcher.ending (settle and answer
what ends here), dispatcher.refresh (the worker view, recovery, weights, the prefix index), over the
attributes declared in dispatcher.state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from redis.exceptions import RedisError

from dispatcher.acts import Acts
from dispatcher.batch_desk import BatchDesk
from dispatcher.hold import Hold
from dispatcher.in_flight import InFlight
from dispatcher.intake import Intake
from dispatcher.leases import LeasedPartitions, Leases
from dispatcher.offsets import OffsetTracker
from dispatcher.refresh import Refreshers
from dispatcher.reporting import report_loop
from dispatcher.settings import DispatcherSettings
from dispatcher.state import REDIS_PAUSE_S
from dispatcher.view import WorkerView
from openai_api.tokenizer import PromptTokenizer
from plumbing.answers import AnswerSink
from plumbing.clients import BusUnavailable
from plumbing.fetch_pacing import FetchPacer
from plumbing.health import Liveness
from plumbing.protocol.request import CONTROL_CHUNK_SCRIPT
from plumbing.state import follow_channel
from plumbing.tasks import stop_tasks

log = structlog.get_logger("sluice.dispatcher")
PLACEMENT_STALE_S = 30.0  # a placement loop with no round for this long is stuck (/healthz 503)


class Dispatcher(Intake, Refreshers):
    def __init__(
        self,
        settings: DispatcherSettings,
        redis: aioredis.Redis,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        tokenizer: PromptTokenizer,
        liveness: Liveness | None = None,
    ) -> None:
        self.settings = settings
        self.liveness = liveness or Liveness()
        self.names = settings.names
        self.redis = redis
        self.consumer = consumer
        self.fetch_pacer = FetchPacer(consumer, settings.kafka_fetch_wait_ms, time.monotonic())
        self.producer = producer
        self.pool = settings.pool
        self.topic = self.names.requests_topic(settings.pool)
        self.batch_topic = self.names.batch_topic(settings.pool)
        self.consumer_id = f"dispatcher-{os.getpid()}-{random.getrandbits(16):04x}"
        self.answers = AnswerSink(
            redis, self.names, lambda: producer, started=producer, sender=self.consumer_id
        )
        self.acts = Acts(redis, settings, producer, self.consumer_id)
        pool_config = settings.load_pools().pool(settings.pool)
        self.block_size = pool_config.block_size
        self.max_migrations = pool_config.max_migrations
        self.disaggregation = pool_config.disaggregation if pool_config.splits else None
        self._log_chunk = redis.register_script(CONTROL_CHUNK_SCRIPT)
        self._redis_failed_at = float("-inf")  # monotonic; lost workers are not recovered right after
        self.batch = BatchDesk(redis, self.names, pool_config, tokenizer, self.answers, self.acts.dead_letter)
        self.policy = settings.policy(pool_config.latency)
        self.view = WorkerView(redis, self.names, settings.pool, self.policy.latency)
        self.hold = Hold(settings.hold_capacity)
        self.offsets: OffsetTracker[tuple[str, int]] = OffsetTracker()
        self.rng = random.Random()
        self._paused: set[str] = set()  # topics whose partitions are paused
        self._teams_seen: set[str] = set()  # teams with a held-requests gauge
        self._background: list[asyncio.Task[None]] = []
        self._unadmitted: list[ConsumerRecord[Any, Any]] = []
        self.in_flight = InFlight()  # batch admissions and answers under way
        leases = Leases(
            redis, self.names.dispatchers(self.pool), self.names.partition_lease(self.pool),
            self.consumer_id, settings.lease_ms,
        )  # fmt: skip
        self.partitions = LeasedPartitions(consumer, leases, (self.topic, self.batch_topic))

    async def run(self, stop: asyncio.Event) -> None:
        self.consumer.assign([])
        await self.view.refresh()
        self._background = [
            asyncio.create_task(self.partitions.keep(stop), name="leases"),
            asyncio.create_task(self._view_loop(stop), name="view"),
            asyncio.create_task(self._kv_loop(stop), name="kv-index"),
            asyncio.create_task(
                follow_channel(self.redis, self.names.cancel_channel(), self._on_cancel), name="cancels"
            ),
            asyncio.create_task(
                follow_channel(self.redis, self.names.heartbeat_channel(self.pool), self._on_heartbeat),
                name="heartbeats",
            ),
            asyncio.create_task(report_loop(self, stop), name="report"),
            asyncio.create_task(self._weights_loop(stop), name="team-weights"),
        ]
        for task in self._background:
            self.liveness.watch(task.get_name(), task)
        self.liveness.watch("placement", stale_after_s=PLACEMENT_STALE_S)
        log.info("dispatcher consuming", topics=[self.topic, self.batch_topic])
        try:
            while not stop.is_set():
                self.liveness.beat("placement")
                await self._follow_leases()
                await self._receive()
                try:
                    await self._place_held()
                    await self._expire()
                except (RedisError, BusUnavailable) as exc:
                    # Requests stay held (their offsets uncommitted) until Redis or the broker answers.
                    log.warning("bus unavailable; placement paused", error=str(exc))
                    await asyncio.sleep(REDIS_PAUSE_S)
                await self._acknowledge()
                self._flow_control()
        finally:
            # Bounded: a task cancelled inside a Redis call can be slow to unwind; shutdown does not wait.
            await stop_tasks(self._background, timeout_s=2.0)
            await self.in_flight.settle(timeout_s=5.0)
            # Requests still held are not committed: whoever leases their partitions next reads them again.
            with contextlib.suppress(Exception):
                await self._acknowledge()
            await self.partitions.hand_back()
