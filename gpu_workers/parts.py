"""What the worker's parts share: its constants and the attributes `Worker.__init__` sets, declared once so
that each part (consuming, serving, beats) is typed against them."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import structlog
from redis.commands.core import AsyncScript

from gpu_workers.engine import Engine
from gpu_workers.first_tokens import FirstTokenLedger
from gpu_workers.inbox import Inbox
from gpu_workers.kv_publisher import KvPublisher
from gpu_workers.prefill import HandoffDesk
from gpu_workers.presence import CompletionRate
from gpu_workers.settings import WorkerSettings
from gpu_workers.slots import Slots
from plumbing.answers import AnswerSink
from plumbing.health import Liveness
from plumbing.publisher import PipelinedPublisher
from queue_schemas.messages import WorkerState
from queue_schemas.names import Names

log = structlog.get_logger("sluice.worker")

KV_PUBLISH_INTERVAL_S = 0.05
CONSUME_ROUND_S = 0.5  # the longest an inbox round waits for a request to end or entries to arrive
REQUEST_FAULT = "the worker failed while serving this request"
# What /healthz calls the worker's loops, and the `loop` label of the items each ended alone.
INBOX_LOOP = "inbox"
REQUEST_ITEMS = "worker.request"
INBOX_ITEMS = "worker.inbox"
# The abort reason of requests this worker gives up without answering: a dispatcher moves them on.
LEAVE: tuple[str, str] = ("", "")


class WorkerParts:
    settings: WorkerSettings
    liveness: Liveness
    names: Names
    engine: Engine
    redis: aioredis.Redis
    publisher: PipelinedPublisher
    model: str
    max_running: int
    light_slots: int  # the engine runs max_running + light_slots (see next_light)
    handoffs: HandoffDesk | None  # prefill/decode handoffs (a pool with prefill workers)
    _engine_ready: asyncio.Event
    state: WorkerState
    started_at: float
    load_seconds: float | None
    _tasks: dict[str, asyncio.Task[None]]
    slots: Slots  # what waits and runs here
    first_tokens: FirstTokenLedger  # what the heartbeat reports for the dispatcher's latency model
    _hb_seq: int
    _beat_soon: asyncio.Event
    inbox: Inbox
    _inbox_seen_empty: bool
    ready_at: float | None
    completions: CompletionRate
    _begin_script: AsyncScript
    kv: KvPublisher
    error: str | None
    tensor_parallel_size: int
    _abort_reason: tuple[str, str]
    _exiting: bool  # draining to exit (a stop), not at the scaler's request
    answers: AnswerSink
