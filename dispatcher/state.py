"""What the dispatcher's parts share: the attributes `Dispatcher.__init__` sets, declared once so that each
part (intake, placing, ending, refresh) is typed against them."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from redis.commands.core import AsyncScript

from dispatcher.acts import Acts
from dispatcher.batch_desk import BatchDesk
from dispatcher.hold import Hold
from dispatcher.in_flight import InFlight
from dispatcher.leases import LeasedPartitions
from dispatcher.offsets import OffsetTracker
from dispatcher.placement import PlacementPolicy
from dispatcher.settings import DispatcherSettings
from dispatcher.view import WorkerView
from plumbing.answers import AnswerSink
from plumbing.fetch_pacing import FetchPacer
from plumbing.health import Liveness
from queue_schemas.config import DisaggregationConfig
from queue_schemas.names import Names

REDIS_PAUSE_S = 0.5  # between placement rounds while Redis does not answer


class DispatcherState:
    settings: DispatcherSettings
    liveness: Liveness
    names: Names
    redis: aioredis.Redis
    consumer: AIOKafkaConsumer
    fetch_pacer: FetchPacer
    producer: AIOKafkaProducer
    pool: str
    topic: str  # the pool's requests topic
    batch_topic: str
    consumer_id: str
    answers: AnswerSink
    acts: Acts
    block_size: int
    max_migrations: int
    disaggregation: DisaggregationConfig | None  # set where the pool splits requests
    _log_chunk: AsyncScript
    _redis_failed_at: float  # monotonic; lost workers are not recovered right after
    batch: BatchDesk
    view: WorkerView
    hold: Hold
    offsets: OffsetTracker[tuple[str, int]]
    policy: PlacementPolicy
    rng: random.Random
    _paused: set[str]  # topics whose partitions are paused
    _teams_seen: set[str]  # teams with a held-requests gauge
    _background: list[asyncio.Task[None]]
    _unadmitted: list[ConsumerRecord[Any, Any]]
    in_flight: InFlight  # batch admissions and answers under way
    partitions: LeasedPartitions
