"""The worker loop: receive from the inbox, check, generate, publish, acknowledge.

Each inbox entry is acknowledged only after its terminal chunk is published, so a worker that dies
leaves its unfinished entries pending in the stream for recovery.

The Worker is made of parts beside this module: gpu_workers.consuming (the inbox and slots),
gpu_workers.serving (one request on the engine), gpu_workers.beats (heartbeats and KV events), over the
attributes and constants in gpu_workers.parts; this module holds start, drain and retirement.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from gpu_workers.beats import Beats
from gpu_workers.consuming import Consuming
from gpu_workers.engine import Engine, EngineError
from gpu_workers.first_tokens import FirstTokenLedger
from gpu_workers.inbox import Inbox
from gpu_workers.kv_publisher import KvPublisher
from gpu_workers.parts import CONSUME_ROUND_S, INBOX_LOOP, KV_PUBLISH_INTERVAL_S, LEAVE, log
from gpu_workers.prefill import HandoffDesk
from gpu_workers.presence import (
    CompletionRate,
    batch_slots,
    leave_pool,
    stale_after_s,
    write_state_file,
)
from gpu_workers.settings import WorkerSettings
from gpu_workers.slots import Slots
from gpu_workers.starting import process_started_at
from plumbing.answers import AnswerSink
from plumbing.clients import producer_options
from plumbing.health import Liveness
from plumbing.protocol.request import BEGIN_SCRIPT
from plumbing.publisher import PipelinedPublisher
from plumbing.state import follow_channel
from plumbing.tasks import stop_tasks
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import (
    WorkerState,
)


class Worker(Consuming, Beats):
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        redis: aioredis.Redis,
        model: str,
        max_running: int,
        light_slots: int = 0,
        handoffs: HandoffDesk | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.settings = settings
        self.liveness = liveness or Liveness()
        self.names = settings.names
        self.engine = engine
        self.redis = redis
        self.publisher = PipelinedPublisher(redis)
        self.model = model
        self.max_running = max_running
        self.light_slots = light_slots  # the engine runs max_running + light_slots (see next_light)
        self.handoffs = handoffs  # prefill/decode handoffs (a pool with prefill workers)
        self._engine_ready = asyncio.Event()
        self.state = WorkerState.STARTING
        self.started_at = process_started_at()
        self.load_seconds: float | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.slots = Slots(
            max_running, light_slots, batch_slots(max_running, settings.batch_headroom_fraction)
        )
        self._hb_seq = 0
        self._beat_soon = asyncio.Event()
        self.inbox = Inbox(redis, self.names, settings.worker_id)
        self._inbox_seen_empty = False
        self.ready_at: float | None = None
        self.completions = CompletionRate()
        self.first_tokens = FirstTokenLedger()
        self._begin_script = redis.register_script(BEGIN_SCRIPT)
        self.kv = KvPublisher(redis, self.names, settings.worker_id)
        self.error: str | None = None
        self.tensor_parallel_size = 1
        self._abort_reason: tuple[str, str] = (ErrorCode.CANCELLED, "the request was cancelled")
        self._exiting = False  # draining to exit (a stop), not at the scaler's request
        self.stopped_starting = False  # stopped before the engine was up: nothing to drain
        self.answers = AnswerSink(
            redis,
            self.names,
            lambda: AIOKafkaProducer(**producer_options(settings)),
            sender=settings.worker_id,
        )

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until `stop` is set (0), or until the engine fails to start or dies (1)."""
        # An earlier process under this id left work: dispatchers move it on now, not after our start-up.
        await self.inbox.hand_over(self.settings.pool)
        background = self._start_background()
        try:
            t0 = time.monotonic()
            try:
                started = await self._start_engine(stop)
            except EngineError as exc:
                await self._fail_worker(f"engine did not start: {exc}")
                return 1
            if not started:
                log.info("stopped while the engine was starting", worker=self.settings.worker_id)
                self.stopped_starting = True
                return 0
            self.load_seconds = time.monotonic() - t0
            await self.kv.reset()
            await self.inbox.ensure()
            self.state = WorkerState.READY
            self.ready_at = time.time()
            self.liveness.watch(INBOX_LOOP, stale_after_s=stale_after_s(CONSUME_ROUND_S))
            self._engine_ready.set()
            await self._publish_heartbeat()
            log.info(
                "worker ready",
                worker=self.settings.worker_id,
                pool=self.settings.pool,
                load_s=self.load_seconds,
            )
            await self._consume(until=lambda: stop.is_set() or self.engine.failure() is not None)
            failure = self.engine.failure()
            if failure is not None:
                await self._fail_worker(failure)
                return 1
            await self._drain()
            return 0
        finally:
            self.liveness.forget(INBOX_LOOP)
            for task in background:
                self.liveness.forget(task.get_name())
            # Bounded: a task cancelled inside a Redis call can be slow to unwind; shutdown does not wait.
            await stop_tasks(background, timeout_s=2.0)
            await self._retire()
            await self.publisher.close()
            await self.answers.close()
            await self.engine.close()

    async def _start_engine(self, stop: asyncio.Event) -> bool:
        """Start the engine; False if `stop` is set first. Nothing is placed on a worker before it is
        ready, so a stop during a start-up of minutes has nothing to wait for."""
        starting = asyncio.ensure_future(self.engine.start())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            starting.cancel()
            raise
        finally:
            stopping.cancel()
        if not starting.done():
            starting.cancel()
            return False
        starting.result()
        return True

    def _start_background(self) -> set[asyncio.Task[None]]:
        """The worker's background loops, each watched by `liveness`; those with a rhythm also beat."""
        heartbeat_s = self.settings.heartbeat_interval_s
        loops: list[tuple[str, Any, float | None]] = [
            ("heartbeat", self._heartbeat_loop(), stale_after_s(heartbeat_s)),
            ("cancels", follow_channel(self.redis, self.names.cancel_channel(), self._on_cancel), None),
            ("kv-events", self._kv_loop(), stale_after_s(KV_PUBLISH_INTERVAL_S)),
        ]
        if self.handoffs is not None and self.settings.role == "prefill":
            loops.append(("prefill", self.handoffs.serve_jobs(self._engine_ready), None))
        background: set[asyncio.Task[None]] = set()
        for name, coro, stale in loops:
            task = asyncio.create_task(coro, name=name)
            self.liveness.watch(name, task, stale_after_s=stale)
            background.add(task)
        return background

    async def _fail_worker(self, reason: str) -> None:
        """The engine cannot serve: say so in the heartbeat and stop. Requests placed here, started or
        not, stay in the inbox unanswered: a dispatcher moves them to another worker, which goes on from
        the tokens already delivered."""
        log.error("worker failed", worker=self.settings.worker_id, reason=reason)
        self.state = WorkerState.FAILED
        self.error = reason
        await self._publish_heartbeat_quietly()
        await self._leave_running()

    async def _drain(self) -> None:
        """Take no new placements; finish what is running and what was already placed here, until a deadline.

        The draining heartbeat goes out first; the grace period covers placements made before the
        dispatchers saw it. Requests still running at the deadline are left to move to another worker.
        """
        self.state = WorkerState.DRAINING
        self._exiting = True
        await self._publish_heartbeat_quietly()
        started = time.monotonic()
        deadline = started + self.settings.drain_timeout_s
        log.info("draining", in_flight=len(self._tasks))

        def drained() -> bool:
            now = time.monotonic()
            settled = (
                now - started >= self.settings.drain_grace_s and not self._tasks and self._inbox_seen_empty
            )
            jobs_done = self.handoffs is None or self.handoffs.backlog == 0  # a prefill worker's queue
            return (settled and jobs_done) or now >= deadline

        self._inbox_seen_empty = False
        await self._consume(until=drained)
        if self._tasks or not self._inbox_seen_empty:
            log.warning(
                "drain deadline reached", running=len(self._tasks), inbox_empty=self._inbox_seen_empty
            )
        await self._leave_running()  # a dispatcher moves what is left once this worker is gone

    async def _leave_running(self) -> None:
        self._abort_reason = LEAVE
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=2.0)

    async def _retire(self) -> None:
        if self.settings.state_file is not None:
            write_state_file(self.settings.state_file, "stopped")
        await leave_pool(self.redis, self.settings, self.inbox, failed=self.state is WorkerState.FAILED)
