"""The worker loop: receive from the inbox, check, generate, publish, acknowledge.

Each inbox entry is acknowledged only after its terminal chunk is published, so a worker that dies
leaves its unfinished entries pending in the stream for recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer
from redis.exceptions import RedisError

from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import EarlyStart, Engine, EngineError, RequestFailed
from gpu_workers.handoff import KvTransfer
from gpu_workers.inbox import Entry, Inbox
from gpu_workers.kv_publisher import KvPublisher
from gpu_workers.metrics import TEAM_TOKENS
from gpu_workers.output import Moved, RequestOutput
from gpu_workers.prefill import HandoffDesk
from gpu_workers.presence import (
    CompletionRate,
    Ready,
    Vitals,
    batch_slots,
    beat_forever,
    engine_load,
    heartbeat,
    leave_pool,
    next_light,
    next_to_start,
    stale_after_s,
    state_on_drain_request,
    write_state_file,
)
from gpu_workers.settings import WorkerSettings
from gpu_workers.starting import STARTED_MARK_TTL_MS, process_started_at, start_refusal
from plumbing.answers import AnswerSink
from plumbing.clients import BusUnavailable, producer_options
from plumbing.health import Liveness, item_failed
from plumbing.protocol.request import BEGIN_SCRIPT, CHUNK_SCRIPT, Begun, begin_keys
from plumbing.publisher import PipelinedPublisher
from plumbing.quota import settle
from plumbing.replay import log_ttl_ms
from plumbing.state import follow_channel, publish_heartbeat
from queue_schemas.codec import decode, encode
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import (
    CancelNotice,
    ErrorChunk,
    FinalChunk,
    InferenceRequest,
    Priority,
    TokenChunk,
    Usage,
    WorkerState,
)
from queue_schemas.names import INBOX_FIELD
from queue_schemas.usage import UsageEvent, UsageStatus, usage_event

RECENT_REQUESTS = 4096  # request ids a worker remembers having run, to drop an entry appended twice
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


class Worker:
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
        self.publisher = PipelinedPublisher(redis, CHUNK_SCRIPT)
        self.model = model
        self.max_running = max_running
        self.light_slots = light_slots  # the engine runs max_running + light_slots (see next_light)
        self.handoffs = handoffs  # prefill/decode handoffs (a pool with prefill workers)
        self._engine_ready = asyncio.Event()
        self.state = WorkerState.STARTING
        self.started_at = process_started_at()
        self.load_seconds: float | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Entries read from the inbox and not started yet: a slot that frees takes the best of them
        # (`next_to_start`), not the oldest. They stay unacknowledged in the inbox, so a dispatcher
        # recovers them with the running ones if this worker is lost.
        self._ready: list[Ready] = []
        self._finished: OrderedDict[str, None] = OrderedDict()  # recent request ids, oldest first
        self._arrivals = itertools.count()
        self._team_of: dict[str, str] = {}  # request id -> team, of the requests running here
        self._running_by_team: Counter[str] = Counter()
        self._batch_running: set[str] = set()  # request ids of the batch requests running here
        self.batch_slots = batch_slots(max_running, settings.batch_headroom_fraction)
        self._hb_seq = 0
        self._beat_soon = asyncio.Event()
        self.inbox = Inbox(redis, self.names, settings.worker_id)
        self._inbox_seen_empty = False
        self.ready_at: float | None = None
        self.completions = CompletionRate()
        self._begin_script = redis.register_script(BEGIN_SCRIPT)
        self.kv = KvPublisher(redis, self.names, settings.worker_id)
        self.error: str | None = None
        self.tensor_parallel_size = 1
        self._abort_reason: tuple[str, str] = (ErrorCode.CANCELLED, "the request was cancelled")
        self._exiting = False  # draining to exit (a stop), not at the scaler's request
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
                await self.engine.start()
            except EngineError as exc:
                await self._fail_worker(f"engine did not start: {exc}")
                return 1
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
                task.cancel()
            # Bounded: a task cancelled inside a Redis call can be slow to unwind; shutdown does not wait.
            await asyncio.wait(background, timeout=2.0)
            await self._retire()
            await self.publisher.close()
            await self.answers.close()
            await self.engine.close()

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

    async def _leave_running(self) -> None:
        self._abort_reason = LEAVE
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=2.0)

    async def _consume(self, until: Callable[[], bool]) -> None:
        """Receive: keep up to max_running requests going until `until()` says stop, and the light slots
        for teams under their share; read ahead up to `inbox_lookahead` entries, and start the best of
        what was read first. One inbox read is outstanding at a time and is never cancelled (entries it
        returns are ours to start or leave unacknowledged); a request that ends wakes the loop at once."""
        reader: asyncio.Task[list[Entry]] | None = None
        try:
            while not until():
                self.liveness.beat(INBOX_LOOP)
                self._start_ready()
                room = self.max_running + self.settings.inbox_lookahead - len(self._tasks) - len(self._ready)
                if reader is None and room > 0:
                    reader = asyncio.create_task(self.inbox.read(room, block_ms=200), name="inbox-read")
                waiting: set[asyncio.Future[Any]] = set(self._tasks.values())
                if reader is not None:
                    waiting.add(reader)
                if not waiting:  # no room to read ahead and nothing running: cannot happen with slots
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=CONSUME_ROUND_S)
                if reader is not None and reader.done():
                    await self._take(reader)
                    reader = None
        finally:
            if reader is not None:
                await asyncio.wait({reader}, timeout=1.0)
                if reader.done():
                    await self._take(reader)
                else:
                    reader.cancel()  # shutdown: unacknowledged entries stay for a dispatcher to move

    async def _take(self, reader: asyncio.Task[list[Entry]]) -> None:
        try:
            entries = reader.result()
        except RedisError as exc:
            log.warning("inbox read failed", error=str(exc))
            await asyncio.sleep(0.5)
            return
        for entry_id, fields in entries:
            try:
                self._accept(entry_id, fields)
            except Exception:  # an entry this worker cannot take: it is dropped alone
                self._drop_entry(entry_id, "the entry could not be taken", exc_info=True)
        self._inbox_seen_empty = not entries and not self._ready

    def _start_ready(self) -> None:
        """Fill free slots from the ready entries: a stated slot takes the best of them (`next_to_start`;
        a batch entry only while batch holds fewer than `batch_slots`), a light slot only an interactive
        entry of a team under its share (`next_light`)."""
        while self._ready:
            if len(self._tasks) < self.max_running:
                room = len(self._batch_running) < self.batch_slots
                chosen: int | None = next_to_start(self._ready, self._running_by_team, room)
            elif len(self._tasks) < self.max_running + self.light_slots:
                chosen = next_light(self._ready, self._running_by_team, self.max_running)
            else:
                chosen = None
            if chosen is None:
                return
            ready = self._ready.pop(chosen)
            self._start(ready.request, ready.entry_id)

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

    def _accept(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode(InferenceRequest, fields.get(INBOX_FIELD, b""))
        except SchemaError as exc:
            self._drop_entry(entry_id, str(exc))
            return
        rid = request.request_id
        if rid in self._tasks or any(r.request.request_id == rid for r in self._ready):
            return
        if rid in self._finished:  # appended again by a dispatcher that could not know it had arrived
            self._spawn(entry_id.decode(), self._ack(entry_id))
            return
        self._ready.append(Ready(request, entry_id, next(self._arrivals)))

    def _drop_entry(self, entry_id: bytes, reason: str, exc_info: bool = False) -> None:
        item_failed(INBOX_ITEMS)
        key = entry_id.decode(errors="replace")
        log.error("poison inbox entry dropped", entry=key, reason=reason, exc_info=exc_info)
        self._spawn(key, self._ack(entry_id))

    def _start(self, request: InferenceRequest, entry_id: bytes) -> None:
        self._team_of[request.request_id] = request.team
        if request.priority is Priority.BATCH:
            self._batch_running.add(request.request_id)
        self._running_by_team[request.team] += 1
        self._spawn(request.request_id, self._serve(request, entry_id))

    def _spawn(self, key: str, coro: Any) -> None:
        task = asyncio.create_task(coro, name=f"serve-{key}")
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._ended(key, t))

    def _ended(self, key: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Raised past its own handling (acknowledging, releasing): the entry stays for recovery.
            item_failed(REQUEST_ITEMS)
            log.error("request task failed", key=key, exc_info=task.exception())
        self._tasks.pop(key, None)
        self._batch_running.discard(key)
        team = self._team_of.pop(key, None)
        if team is not None:
            self._finished[key] = None
            if len(self._finished) > RECENT_REQUESTS:
                self._finished.popitem(last=False)
            self._running_by_team[team] -= 1
            if not self._running_by_team[team]:
                del self._running_by_team[team]
        self._beat_soon.set()

    async def _serve(self, request: InferenceRequest, entry_id: bytes) -> None:
        """Run one request to its terminal chunk, settle the team's quota, then acknowledge the entry."""
        out = RequestOutput(
            request, self.publisher, self.answers, self.names, self.settings.worker_id,
            self.settings.bus_outage_s, self.settings.stream_publish,
        )  # fmt: skip
        coalescer = ChunkCoalescer(
            request.request_id, self.settings.worker_id, self.settings.flush_interval_ms / 1000,
            request.resume,
        )  # fmt: skip
        started = False
        pieces: EarlyStart | None = None
        loaded: KvTransfer | None = None

        def produced() -> bool:
            """Whether the engine gave output: a request stopped after that is charged what it used."""
            return started or coalescer.completion_tokens > 0

        try:
            refusal = start_refusal(request, time.time())
            if refusal is None and request.handoff is not None and self.handoffs is not None:
                loaded = (await self.handoffs.await_kv(request)).kv  # None: prefilled here
            if refusal is None:
                # Prefill starts at once; the start check goes out with the first chunk.
                pieces = EarlyStart(self.engine.generate(request, loaded))
                outcome = await self._open(out, pieces, coalescer)
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
                assert pieces is not None
                started = True
                async for piece in pieces:
                    await self._deliver(out, coalescer.add(piece, time.monotonic()))
        except EngineError as exc:
            if self.engine.failure() is not None:
                # The engine is dead, not this request: the worker fails, and a dispatcher moves the
                # request to another worker from what was delivered.
                log.warning("engine died; request left for another worker", request_id=request.request_id)
                return
            log.error("engine failed on a request", request_id=request.request_id, error=str(exc))
            await self._fail(out, coalescer, produced(), ErrorCode.ENGINE_ERROR, str(exc))
        except Moved:
            log.warning("request moved to another worker; stopping here", request_id=request.request_id)
        except asyncio.CancelledError:
            if self._abort_reason is LEAVE:
                # This worker is going away: the entry stays, and a dispatcher moves the request on from
                # what its log shows was delivered (its quota reservation stays for whoever finishes it).
                log.warning("request left for another worker", request_id=request.request_id)
                return
            await self._fail(out, coalescer, produced(), *self._abort_reason)
        except (RedisError, BusUnavailable) as exc:
            log.error("lost the bus while answering", request_id=request.request_id, error=str(exc))
            return  # not acknowledged: the entry stays pending for recovery
        except Exception as exc:  # a fault of this request alone: it ends, the worker goes on
            log.error(
                "request failed", request_id=request.request_id, error=type(exc).__name__, exc_info=True
            )
            if not await self._fail_alone(out, coalescer, produced()):
                return  # the entry stays pending for recovery
        finally:
            if pieces is not None:
                await pieces.discard()
            if loaded is not None and self.handoffs is not None:
                await self.handoffs.release(loaded)
        await self._ack(entry_id)

    async def _open(self, out: RequestOutput, pieces: EarlyStart, coalescer: ChunkCoalescer) -> str:
        """Start the request once the engine has its first output: 'ok' when that output is delivered,
        else 'moved' or 'cancelled' (the engine stream is aborted and nothing was published).

        A streamed request's start check and first chunk are one script. A batch request (its output is
        gathered) and a one-chunk answer (settled before it is sent) are checked, then delivered; so is
        an engine failure, which only the worker that still holds the request reports.
        """
        request = out.request
        try:
            first = await anext(pieces, None)
            if first is None:
                raise RequestFailed("the engine ended the request without output")
            out.timing = replace(out.timing, first_token=time.time())
        except EngineError:
            outcome = await self._begin(request)
            if outcome == "ok":
                raise
            await pieces.discard()
            return outcome
        chunk = coalescer.add(first, time.monotonic())
        if request.batch is None and isinstance(chunk, TokenChunk):
            outcome = await self._begin(request, chunk)
        else:
            outcome = await self._begin(request)
            if outcome == "ok":
                await self._deliver(out, chunk)
        if outcome != "ok":
            await pieces.discard()
        return outcome

    async def _deliver(self, out: RequestOutput, chunk: TokenChunk | FinalChunk | None) -> None:
        if isinstance(chunk, FinalChunk):
            event = usage_event(out.request, UsageStatus.COMPLETED, chunk.usage, time.time(), out.timing)
            await self._settle(out.request, chunk.usage.total_tokens, event)
            self.completions.record(time.monotonic())
        if chunk is not None:
            await out.emit(chunk)

    async def _begin(self, request: InferenceRequest, first: TokenChunk | None = None) -> str:
        names = self.names
        rid = request.request_id
        keys = begin_keys(names, rid)
        args: list[str | bytes | int] = [self.settings.worker_id, STARTED_MARK_TTL_MS]
        if first is not None:
            ttl = log_ttl_ms(request.deadline, time.time(), False, request.keep_log_s)
            args += [self.settings.stream_publish, encode(first), first.seq, ttl]
        outcome = await self._begin_script(keys=keys, args=args)
        return Begun(outcome.decode() if isinstance(outcome, bytes) else str(outcome))

    async def _settle(self, request: InferenceRequest, used_tokens: int, usage: UsageEvent) -> None:
        TEAM_TOKENS.labels(request.pool, request.team).inc(used_tokens)
        try:
            await settle(self.redis, self.names, request.team, request.request_id, used_tokens, usage)
        except RedisError as exc:
            log.warning("quota not settled", request_id=request.request_id, error=str(exc))

    async def _fail(
        self, out: RequestOutput, coalescer: ChunkCoalescer, started: bool, code: str, message: str
    ) -> None:
        """Settle what the engine really did (nothing, if it never started), then send the error chunk."""
        request = out.request
        prompt = request.client_prompt_tokens if started else 0
        used = prompt + coalescer.completion_tokens if started else 0
        status = UsageStatus.CANCELLED if code == ErrorCode.CANCELLED else UsageStatus.FAILED
        usage = Usage(prompt_tokens=prompt, completion_tokens=coalescer.completion_tokens if started else 0)
        event = usage_event(request, status, usage, time.time(), out.timing, error_code=code)
        await self._settle(request, used, event)
        pending = coalescer.flush()
        chunk = ErrorChunk(request_id=request.request_id, seq=coalescer.seq, code=code, message=message)
        if request.batch is not None:
            await out.emit(chunk)  # raises only when the broker is down: the entry stays pending
            return
        with contextlib.suppress(RedisError, Moved):
            if pending is not None:
                await out.emit(pending)
            await out.emit(chunk)

    async def _fail_alone(self, out: RequestOutput, coalescer: ChunkCoalescer, started: bool) -> bool:
        """End a request whose handling raised with an error chunk, and count it. False when the bus is
        down (the entry stays pending for recovery); True otherwise, even when the chunk itself could not
        be sent, so a request that cannot be answered is acknowledged rather than tried again."""
        item_failed(REQUEST_ITEMS)
        try:
            await self._fail(out, coalescer, started, ErrorCode.ENGINE_ERROR, REQUEST_FAULT)
        except (RedisError, BusUnavailable):
            return False
        except Exception as exc:
            log.error("error chunk not sent", request_id=out.request.request_id, error=type(exc).__name__)
        return True

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
            self.liveness.beat("kv-events")
            if self.state in (WorkerState.STARTING, WorkerState.FAILED):
                continue
            try:
                await self.kv.publish(self.engine.take_kv_changes())
            except RedisError as exc:
                # The mirror moved on: consumers see a gap and resync from the next snapshot.
                log.warning("kv events not published", error=str(exc))
            except Exception as exc:  # these changes are lost alone; consumers resync the same way
                item_failed("worker.kv_events")
                log.error("kv events dropped", error=type(exc).__name__, exc_info=True)

    async def _heartbeat_loop(self) -> None:
        await beat_forever(self._heartbeat_round, self.settings.heartbeat_interval_s, self._beat_soon)

    async def _heartbeat_round(self) -> None:
        """One heartbeat; one that cannot be built or written (other than Redis failing) is skipped."""
        self.liveness.beat("heartbeat")
        try:
            await self._publish_heartbeat()
        except RedisError:
            raise
        except Exception as exc:
            item_failed("worker.heartbeat")
            log.error("heartbeat skipped", error=type(exc).__name__, exc_info=True)

    async def _publish_heartbeat(self) -> None:
        if not self._exiting and self.state in (WorkerState.READY, WorkerState.DRAINING):
            asked = bool(await self.redis.exists(self.names.drain_request(self.settings.worker_id)))
            state = state_on_drain_request(self.state, asked)
            if state is not self.state:
                log.info("drain requested" if asked else "drain withdrawn", worker=self.settings.worker_id)
            self.state = state
        # Awaited before the fields are read, so one heartbeat never mixes states from either side of it.
        inbox_pending = await self.inbox.undelivered() + len(self._ready)
        self._hb_seq += 1
        hb = heartbeat(
            self.settings, self.model, self.vitals(), engine_load(self.engine.stats(), len(self._tasks)),
            inbox_pending, seq=self._hb_seq, kv_seq=self.kv.seq,
            completed_per_s=self.completions.rate(time.monotonic()),
        )  # fmt: skip
        if self.handoffs is not None and self.settings.role == "prefill":
            hb = hb.model_copy(
                update={
                    "prefill_tokens_per_s": self.handoffs.rate.tokens_per_s,
                    "prefill_backlog": self.handoffs.backlog,
                }
            )
        await publish_heartbeat(self.redis, self.names, hb)
        if self.settings.state_file is not None:
            write_state_file(self.settings.state_file, hb.state)

    def vitals(self) -> Vitals:
        return Vitals(
            self.state, self.started_at, self.load_seconds, self.ready_at, self.error,
            self.max_running, self.tensor_parallel_size, self.light_slots,
        )  # fmt: skip

    async def _publish_heartbeat_quietly(self) -> None:
        with contextlib.suppress(RedisError):
            await self._publish_heartbeat()

    async def _retire(self) -> None:
        if self.settings.state_file is not None:
            write_state_file(self.settings.state_file, "stopped")
        await leave_pool(self.redis, self.settings, self.inbox, failed=self.state is WorkerState.FAILED)
