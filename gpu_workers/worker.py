"""The worker loop: receive from the inbox, check, generate, publish, acknowledge.

Each inbox entry is acknowledged only after its terminal chunk is published, so a worker that dies
leaves its unfinished entries pending in the stream for recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer
from redis.exceptions import RedisError

from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import Engine, EngineError
from gpu_workers.inbox import Inbox
from gpu_workers.kv_publisher import KvPublisher
from gpu_workers.settings import WorkerSettings
from gpu_workers.starting import (
    BEGIN_SCRIPT,
    FAILED_HEARTBEAT_TTL_MS,
    STARTED_MARK_TTL_MS,
    process_started_at,
    start_refusal,
)
from queue_schemas.answers import AnswerSink
from queue_schemas.batch import BatchAnswer, completed_answer, failed_answer
from queue_schemas.clients import BusUnavailable, producer_options, with_backoff
from queue_schemas.codec import decode, encode
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import (
    CancelNotice,
    ErrorChunk,
    FinalChunk,
    Heartbeat,
    InferenceRequest,
    TokenChunk,
    WorkerState,
)
from queue_schemas.publisher import PipelinedPublisher
from queue_schemas.quota import settle
from queue_schemas.state import follow_channel, publish_heartbeat

log = structlog.get_logger("sluice.worker")

INBOX_FIELD = b"m"
ANSWER_ATTEMPTS = 8
MIN_HEARTBEAT_GAP_S = 0.05
KV_PUBLISH_INTERVAL_S = 0.05


class Worker:
    def __init__(
        self, settings: WorkerSettings, engine: Engine, redis: aioredis.Redis, model: str, max_running: int
    ) -> None:
        self.settings = settings
        self.names = settings.names
        self.engine = engine
        self.redis = redis
        self.publisher = PipelinedPublisher(redis)
        self.model = model
        self.max_running = max_running
        self.state = WorkerState.STARTING
        self.started_at = process_started_at()
        self.load_seconds: float | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._hb_seq = 0
        self._beat_soon = asyncio.Event()
        self.inbox = Inbox(redis, self.names, settings.worker_id)
        self._inbox_seen_empty = False
        self.ready_at: float | None = None
        self._completed: deque[float] = deque()
        self._begin_script = redis.register_script(BEGIN_SCRIPT)
        self.kv = KvPublisher(redis, self.names, settings.worker_id)
        self.error: str | None = None
        self.tensor_parallel_size = 1
        self._abort_reason = (ErrorCode.CANCELLED, "the request was cancelled")
        self.answers = AnswerSink(redis, self.names, lambda: AIOKafkaProducer(**producer_options(settings)))

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until `stop` is set (0), or until the engine fails to start or dies (1)."""
        heartbeats = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        cancels = asyncio.create_task(
            follow_channel(self.redis, self.names.cancel_channel(), self._on_cancel)
        )
        kv_events = asyncio.create_task(self._kv_loop(), name="kv-events")
        try:
            t0 = time.monotonic()
            try:
                await self.engine.start()
            except EngineError as exc:
                await self._fail_worker(f"engine did not start: {exc}")
                return 1
            self.load_seconds = time.monotonic() - t0
            await self.kv.reset()
            await self.inbox.ensure()
            self.state = WorkerState.READY
            self.ready_at = time.time()
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
            background = {heartbeats, cancels, kv_events}
            for task in background:
                task.cancel()
            # Bounded: a task cancelled inside a Redis call can be slow to unwind; shutdown does not wait.
            await asyncio.wait(background, timeout=2.0)
            await self._retire()
            await self.publisher.close()
            await self.answers.close()
            await self.engine.close()

    async def _fail_worker(self, reason: str) -> None:
        """The engine cannot serve: say so in the heartbeat, end running requests with an error event.
        Entries placed here but not started stay in the inbox for a dispatcher to take over."""
        log.error("worker failed", worker=self.settings.worker_id, reason=reason)
        self.state = WorkerState.FAILED
        self.error = reason
        await self._publish_heartbeat_quietly()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=2.0)
        self._abort_reason = (ErrorCode.ENGINE_ERROR, reason)
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=2.0)

    async def _consume(self, until: Callable[[], bool]) -> None:
        """Receive: keep up to max_running requests going until `until()` says stop."""
        while not until():
            free = self.max_running - len(self._tasks)
            if free <= 0:
                await asyncio.wait(
                    list(self._tasks.values()), return_when=asyncio.FIRST_COMPLETED, timeout=0.5
                )
                continue
            try:
                entries = await self.inbox.read(free, block_ms=200)
            except RedisError as exc:
                log.warning("inbox read failed", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            self._inbox_seen_empty = not entries
            for entry_id, fields in entries:
                self._accept(entry_id, fields)

    async def _drain(self) -> None:
        """Take no new placements; finish what is running and what was already placed here, until a deadline.

        The draining heartbeat goes out first; the grace period covers placements made before the
        dispatchers saw it. Requests still running at the deadline end with an error event.
        """
        self.state = WorkerState.DRAINING
        await self._publish_heartbeat_quietly()
        started = time.monotonic()
        deadline = started + self.settings.drain_timeout_s
        log.info("draining", in_flight=len(self._tasks))

        def drained() -> bool:
            now = time.monotonic()
            settled = (
                now - started >= self.settings.drain_grace_s and not self._tasks and self._inbox_seen_empty
            )
            return settled or now >= deadline

        self._inbox_seen_empty = False
        await self._consume(until=drained)
        if self._tasks or not self._inbox_seen_empty:
            log.warning(
                "drain deadline reached", running=len(self._tasks), inbox_empty=self._inbox_seen_empty
            )
        self._abort_reason = (ErrorCode.WORKER_LOST, "the worker shut down before the request finished")
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=2.0)

    def _accept(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode(InferenceRequest, fields.get(INBOX_FIELD, b""))
        except SchemaError as exc:
            log.error("poison inbox entry dropped", entry=entry_id.decode(), reason=str(exc))
            self._spawn(entry_id.decode(), self._ack(entry_id))
            return
        if request.request_id in self._tasks:
            return
        self._spawn(request.request_id, self._serve(request, entry_id))

    def _spawn(self, key: str, coro: Any) -> None:
        task = asyncio.create_task(coro, name=f"serve-{key}")
        self._tasks[key] = task
        task.add_done_callback(lambda _t: self._ended(key))

    def _ended(self, key: str) -> None:
        self._tasks.pop(key, None)
        self._beat_soon.set()

    async def _serve(self, request: InferenceRequest, entry_id: bytes) -> None:
        """Run one request to its terminal chunk, settle the team's quota, then acknowledge the entry."""
        out = _Output(request)
        coalescer = ChunkCoalescer(
            request.request_id, self.settings.worker_id, self.settings.flush_interval_ms / 1000
        )
        started = False
        try:
            refusal = start_refusal(request, time.time())
            if refusal is None:
                outcome = await self._begin(request)
                if outcome == "moved":
                    log.warning(
                        "request was moved to another worker; skipping", request_id=request.request_id
                    )
                    await self._ack(entry_id)
                    return
                if outcome == "cancelled":
                    refusal = ErrorCode.CANCELLED, "the request was cancelled before it started"
            if refusal is not None:
                await self._fail(out, coalescer, started, *refusal)
            else:
                async for piece in self.engine.generate(request):
                    started = True
                    chunk = coalescer.add(piece, time.monotonic())
                    if isinstance(chunk, FinalChunk):
                        await self._settle(request, chunk.usage.total_tokens)
                        self._completed.append(time.monotonic())
                    if chunk is not None:
                        await self._emit(out, chunk)
        except EngineError as exc:
            log.error("engine failed on a request", request_id=request.request_id, error=str(exc))
            await self._fail(out, coalescer, started, ErrorCode.ENGINE_ERROR, str(exc))
        except asyncio.CancelledError:
            if request.batch is not None and self._abort_reason[0] != ErrorCode.CANCELLED:
                # This worker is going away; nobody has seen the output, so a dispatcher places the
                # entry again (its quota reservation stays for whoever finishes it).
                log.warning("batch request left for another worker", request_id=request.request_id)
                return
            await self._fail(out, coalescer, started, *self._abort_reason)
        except (RedisError, BusUnavailable) as exc:
            log.error("lost the bus while answering", request_id=request.request_id, error=str(exc))
            return  # not acknowledged: the entry stays pending for recovery
        await self._ack(entry_id)

    async def _begin(self, request: InferenceRequest) -> str:
        names = self.names
        keys = [names.cancelled(request.request_id), names.placement(request.request_id)]
        keys.append(names.started(request.request_id))
        outcome = await self._begin_script(keys=keys, args=[self.settings.worker_id, STARTED_MARK_TTL_MS])
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    async def _settle(self, request: InferenceRequest, used_tokens: int) -> None:
        try:
            await settle(self.redis, self.names, request.request_id, used_tokens)
        except RedisError as exc:
            log.warning("quota not settled", request_id=request.request_id, error=str(exc))

    async def _fail(
        self, out: _Output, coalescer: ChunkCoalescer, started: bool, code: str, message: str
    ) -> None:
        """Settle what the engine really did (nothing, if it never started), then send the error chunk."""
        request = out.request
        used = len(request.prompt_token_ids) + coalescer.completion_tokens if started else 0
        await self._settle(request, used)
        pending = coalescer.flush()
        chunk = ErrorChunk(request_id=request.request_id, seq=coalescer.seq, code=code, message=message)
        if request.batch is not None:
            await self._emit(out, chunk)  # a batch answer that cannot be delivered stays pending
            return
        with contextlib.suppress(RedisError):
            if pending is not None:
                await self._emit(out, pending)
            await self._emit(out, chunk)

    async def _emit(self, out: _Output, chunk: TokenChunk | FinalChunk | ErrorChunk) -> None:
        """Stream the chunk to the client's channel; for a batch request, gather it and deliver the whole
        answer on the reply topic at the end."""
        request = out.request
        if request.batch is None:
            await self.publisher.publish(self.names.stream_channel(request.request_id), encode(chunk))
            return
        answer = out.add(chunk)
        if answer is not None:
            topic = request.reply_topic
            assert topic is not None
            await with_backoff(
                lambda: self.answers.deliver(topic, request.request_id, answer),
                "delivering a batch answer",
                attempts=ANSWER_ATTEMPTS,
            )

    async def _ack(self, entry_id: bytes) -> None:
        await self.inbox.done(entry_id)

    def _on_cancel(self, data: bytes) -> None:
        try:
            notice = decode(CancelNotice, data)
        except SchemaError as exc:
            log.warning("bad cancel notice", reason=str(exc))
            return
        task = self._tasks.get(notice.request_id)
        if task is not None:
            log.info("cancelling request", request_id=notice.request_id, reason=notice.reason)
            task.cancel()

    async def _kv_loop(self) -> None:
        while True:
            await asyncio.sleep(KV_PUBLISH_INTERVAL_S)
            if self.state in (WorkerState.STARTING, WorkerState.FAILED):
                continue
            try:
                await self.kv.publish(self.engine.take_kv_changes())
            except RedisError as exc:
                # The mirror moved on: consumers see a gap and resync from the next snapshot.
                log.warning("kv events not published", error=str(exc))

    async def _heartbeat_loop(self) -> None:
        """A heartbeat every interval, and one soon after a request ends (at most every
        MIN_HEARTBEAT_GAP_S), so dispatchers see freed slots before the next regular one."""
        while True:
            self._beat_soon.clear()
            sent = time.monotonic()
            try:
                await self._publish_heartbeat()
            except RedisError as exc:
                log.warning("heartbeat failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_soon.wait(), self.settings.heartbeat_interval_s)
            await asyncio.sleep(max(0.0, MIN_HEARTBEAT_GAP_S - (time.monotonic() - sent)))

    def _completion_rate(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        while self._completed and now - self._completed[0] > window_s:
            self._completed.popleft()
        return len(self._completed) / window_s

    async def _publish_heartbeat(self) -> None:
        # Awaited before the fields are read, so one heartbeat never mixes states from either side of it.
        inbox_pending = await self.inbox.undelivered()
        stats = self.engine.stats()
        self._hb_seq += 1
        hb = Heartbeat(
            worker_id=self.settings.worker_id,
            pool=self.settings.pool,
            model=self.model,
            state=self.state,
            seq=self._hb_seq,
            sent_at=time.time(),
            ttl_ms=FAILED_HEARTBEAT_TTL_MS
            if self.state is WorkerState.FAILED
            else self.settings.heartbeat_ttl_ms,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free,
            block_size=stats.block_size,
            running=stats.running,
            waiting=stats.waiting,
            inbox_pending=inbox_pending,
            max_running=self.max_running,
            decode_tokens_per_s=stats.decode_tokens_per_s,
            started_at=self.started_at,
            load_seconds=self.load_seconds,
            kv_events=True,
            kv_index_seq=self.kv.seq,
            spec_decoding=self.settings.spec_decoding,
            ready_at=self.ready_at,
            completed_per_s=self._completion_rate(),
            tensor_parallel_size=self.tensor_parallel_size,
            prefix_query_tokens=stats.prefix_query_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            error=self.error,
        )
        await publish_heartbeat(self.redis, self.names, hb)
        if self.settings.state_file is not None:
            write_state_file(self.settings.state_file, hb.state)

    async def _publish_heartbeat_quietly(self) -> None:
        with contextlib.suppress(RedisError):
            await self._publish_heartbeat()

    async def _retire(self) -> None:
        if self.settings.state_file is not None:
            write_state_file(self.settings.state_file, "stopped")
        """Leave the pool. Entries still in the inbox stay there with our membership, and the missing
        heartbeat makes a dispatcher take them over at once. A failed worker leaves its `failed` heartbeat
        and membership for ops to see; dispatchers treat it as gone and clean up after it."""
        names = self.names
        failed = self.state is WorkerState.FAILED
        with contextlib.suppress(RedisError):
            left = await self.inbox.length()
            async with self.redis.pipeline(transaction=False) as pipe:
                if not failed:
                    pipe.delete(names.heartbeat(self.settings.pool, self.settings.worker_id))
                if not left and not failed:
                    pipe.srem(names.workers(self.settings.pool), self.settings.worker_id)
                    pipe.delete(
                        names.kv_index(self.settings.worker_id), names.kv_snapshot(self.settings.worker_id)
                    )
                await pipe.execute()
            if left:
                log.warning("left unfinished entries for a dispatcher to take over", entries=left)
        log.info("worker stopped", worker=self.settings.worker_id)


class _Output:
    """Where a request's chunks go; a batch request's text is gathered into one answer."""

    def __init__(self, request: InferenceRequest) -> None:
        self.request = request
        self._parts: list[str] = []

    def add(self, chunk: TokenChunk | FinalChunk | ErrorChunk) -> BatchAnswer | None:
        """The batch answer once `chunk` ends the request, else None."""
        if isinstance(chunk, ErrorChunk):
            return failed_answer(self.request, chunk.code, chunk.message)
        self._parts.append(chunk.text)
        if isinstance(chunk, FinalChunk):
            return completed_answer(self.request, "".join(self._parts), chunk.finish_reason, chunk.usage)
        return None


def write_state_file(path: Path, state: str) -> None:
    """The worker's state for a readiness probe (`grep -qx ready FILE`), replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(state + "\n")
    tmp.replace(path)
