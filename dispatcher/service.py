"""The dispatcher loop of one pool: receive, decide, act, acknowledge.

Its partitions come from leases in Redis (dispatcher.leases), shared with the pool's other dispatchers.

- receive: records from the pool's topic go into the hold (malformed ones to the dead-letter topic);
- decide: held requests, in priority and fairness order, are offered to the placement function;
- act: one script records the placement (SET if absent, on the request id) and appends to the worker's
  inbox, so a redelivered record is recognised and not placed twice;
- acknowledge: each partition's offset is committed up to its oldest request still held.

When the hold is full the partitions are paused, so backlog stays in Kafka as lag for the scaler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from redis.exceptions import RedisError

from dispatcher import metrics
from dispatcher.acts import Acts
from dispatcher.batch_desk import BatchDesk, Refusal, Reserve
from dispatcher.disagg import choose_prefill, decide_split, split_case
from dispatcher.hold import Held, Hold, team_weights
from dispatcher.in_flight import InFlight
from dispatcher.leases import LeasedPartitions, Leases
from dispatcher.migration import decide_move
from dispatcher.offsets import OffsetTracker
from dispatcher.placement import Demand, choose_least_loaded
from dispatcher.recovery import take_over
from dispatcher.reporting import report_loop
from dispatcher.settings import DispatcherSettings
from dispatcher.view import WorkerView
from openai_api.tokenizer import PromptTokenizer
from plumbing.answers import AnswerSink
from plumbing.clients import BusUnavailable, mget_any
from plumbing.health import Liveness, item_failed
from plumbing.protocol.request import CHUNK_SCRIPT, chunk_args
from plumbing.quota import settle
from plumbing.replay import log_ttl_ms, read_log
from plumbing.state import follow_channel
from queue_schemas.codec import decode, encode
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import (
    CancelNotice,
    ErrorChunk,
    Handoff,
    Heartbeat,
    InferenceRequest,
    Priority,
    Usage,
)
from queue_schemas.usage import UsageStatus, usage_event

log = structlog.get_logger("sluice.dispatcher")
REDIS_PAUSE_S = 0.5  # between placement rounds while Redis does not answer
PLACEMENT_STALE_S = 30.0  # a placement loop with no round for this long is stuck (/healthz 503)


class Dispatcher:
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
        self._log_chunk = redis.register_script(CHUNK_SCRIPT)
        self._redis_failed_at = float("-inf")  # monotonic; lost workers are not recovered right after
        self.batch = BatchDesk(redis, self.names, pool_config, tokenizer, self.answers, self.acts.dead_letter)
        self.view = WorkerView(redis, self.names, settings.pool)
        self.hold = Hold(settings.hold_capacity)
        self.offsets: OffsetTracker[tuple[str, int]] = OffsetTracker()
        self.policy = settings.policy()
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
            for task in self._background:
                task.cancel()
            # Bounded: a task cancelled inside a Redis call can be slow to unwind; shutdown does not wait.
            await asyncio.wait(self._background, timeout=2.0)
            await self.in_flight.settle(timeout_s=5.0)
            # Requests still held are not committed: whoever leases their partitions next reads them again.
            with contextlib.suppress(Exception):
                await self._acknowledge()
            await self.partitions.hand_back()

    # partitions
    async def _follow_leases(self) -> None:
        """Consume exactly the leased partitions. One given up first commits what is finished and
        forgets what is held from it (the next holder reads those records again)."""
        dropped = self.partitions.to_drop()
        if dropped:
            with contextlib.suppress(Exception):
                await self._acknowledge()
            self.revoked(dropped)
        self.partitions.follow(dropped, self._paused)
        metrics.CONSUMING.labels(self.pool).set(len(self.partitions.owned()))

    # receive
    async def _receive(self) -> None:
        if self._unadmitted:  # batch records whose admission met a Redis failure: theirs is the next try
            retry, self._unadmitted = self._unadmitted, []
            for record in retry:
                self.in_flight.start(self._admit_batch(record), "admit")
        wait_ms = int(self.settings.hold_poll_s * 1000) if len(self.hold) else 200
        batches: dict[TopicPartition, list[ConsumerRecord[Any, Any]]] = await self.consumer.getmany(
            timeout_ms=wait_ms, max_records=self.settings.fetch_max_records
        )
        batch_records = []
        for tp, records in batches.items():
            kind = "batch" if tp.topic == self.batch_topic else "requests"
            metrics.RECEIVED.labels(self.pool, kind).inc(len(records))
            for record in records:
                self.offsets.opened((tp.topic, tp.partition), record.offset)
                if tp.topic == self.batch_topic:
                    batch_records.append(record)
                else:
                    await self._admit(record)
        # Interactive records first; batch ones are admitted in the background (their signatures, schema
        # checks and tokenizing), so neither a large fetch of them nor a slow one holds up placement.
        for record in batch_records:
            self.in_flight.start(self._admit_batch(record), "admit")

    async def _admit_batch(self, record: ConsumerRecord[Any, Any]) -> None:
        source = (record.topic, record.partition)
        try:
            request = await self.batch.admit(record)
        except (RedisError, BusUnavailable) as exc:
            log.warning("batch record not admitted yet; bus unavailable", error=str(exc))
            self._unadmitted.append(record)  # its offset stays open: it is neither lost nor committed
            return
        except Exception as exc:  # a fault of this record's alone: dead-lettered, never the loop's end
            log.error("batch record failed admission", error=type(exc).__name__, exc_info=True)
            with contextlib.suppress(BusUnavailable):
                await self.acts.dead_letter(record, f"admission failed: {type(exc).__name__}")
            self.offsets.closed(source, record.offset)
            return
        if isinstance(request, Refusal):
            self.in_flight.deliver(
                request.send,
                done=lambda: self.offsets.closed(source, record.offset),
                retry=lambda: self._unadmitted.append(record),
            )
        elif request is None:
            self.offsets.closed(source, record.offset)
        elif not self.hold.add(Held(request, source, record.offset, time.monotonic())) and (
            not self.hold.holds_record(request.request_id, source, record.offset)
        ):
            self.offsets.closed(source, record.offset)  # another record of a request already held

    async def _admit(self, record: ConsumerRecord[Any, Any]) -> None:
        try:
            request = decode(InferenceRequest, record.value or b"")
            if request.pool != self.pool:
                raise SchemaError(
                    f"request for pool {request.pool!r} arrived on the topic of pool {self.pool!r}"
                )
        except SchemaError as exc:
            with contextlib.suppress(BusUnavailable):  # logged by the dead-letter path
                await self.acts.dead_letter(record, str(exc))
            self.offsets.closed((record.topic, record.partition), record.offset)
            return
        if request.handoff is not None:  # only the placing dispatcher may ask for one
            request = request.model_copy(update={"handoff": None})
        source = (record.topic, record.partition)
        held = Held(request, source, record.offset, time.monotonic())
        if not self.hold.add(held):
            metrics.OUTCOMES.labels(self.pool, "duplicate").inc()
            # The same record read again keeps its offset open for the held copy; another record of the
            # request is done with.
            if not self.hold.holds_record(request.request_id, source, record.offset):
                self.offsets.closed(source, record.offset)

    # decide and act
    async def _place_held(self) -> None:
        if not len(self.hold):
            return
        misses = batch_tries = 0
        now = time.time()
        for held in list(self.hold.ordered()):
            if held.not_before > now:
                continue
            if held.request.priority is Priority.BATCH:
                batch_tries += 1
                if batch_tries > self.settings.batch_per_round:
                    break  # back to receiving, so an interactive request never waits behind a long round
            tag = self.hold.tag(held.request.team)  # as it stands now: earlier placements are charged
            if held.request.fair_tag != tag:
                held.request = held.request.model_copy(update={"fair_tag": tag})
            try:
                placed = await self._try_place(held)
            except (RedisError, BusUnavailable):
                raise  # the loop's own pause: the request stays held
            except Exception as exc:  # a fault of this request's alone: it ends, the round goes on
                self._end_failed(held, exc)
                placed = True
            misses = 0 if placed else misses + 1
            if misses >= self.settings.max_misses_per_round:
                break  # nothing fits now; the rest of the hold waits for the next heartbeat
        self._export_hold()

    async def _try_place(self, held: Held) -> bool:
        logged = 0
        if held.taken_over is not None:
            moving = await self._prepare_move(held)
            if moving is None:
                return True
            logged = moving
        request = held.request
        waited = max(0.0, time.monotonic() - held.arrived)
        demand = Demand(
            len(request.prompt_token_ids),
            request.block_hashes,
            request.sampling.max_tokens,
            request.priority,
            waited,
            light=request.priority is Priority.INTERACTIVE and self.hold.held_of(request.team) <= 1,
            adapter=request.adapter,
        )
        t0 = time.perf_counter()
        if self.settings.placement == "scored":
            decision = self.view.decide(demand, time.time(), self.policy, self.rng)
        else:
            snapshot = self.view.snapshot(request.block_hashes)
            decision = choose_least_loaded(snapshot, demand, time.time(), self.policy, self.rng)
        handoff = None
        if decision.worker_id is not None and self.disaggregation is not None:
            handoff = self._handoff(request, decision.worker_id, decision.matched_blocks)
        metrics.DECISION_SECONDS.labels(self.pool).observe(time.perf_counter() - t0)
        if decision.worker_id is None:
            return False
        if handoff is not request.handoff:
            held.request = request = request.model_copy(update={"handoff": handoff})
        reserved = await self.batch.reserve(held)
        if isinstance(reserved, Refusal):
            self._answer_soon(held, reserved.send)
            return True
        if reserved is not Reserve.GO:
            return False
        outcome = await self.acts.place(held, decision, logged)
        if outcome == "placed":
            if held.taken_over is not None:
                moved = held.request.resume is not None and held.request is not held.taken_over
                await self._count_move("moved" if moved else "restarted")
                log.info(
                    "request of a lost worker placed again", request_id=request.request_id,
                    worker=decision.worker_id, moved_from=held.moved_from, continued=moved,
                )  # fmt: skip
            self._finish(held)
            self.hold.charge(request.team, held.cost)
            metrics.TEAM_PLACED_TOKENS.labels(self.pool, request.team).inc(held.cost)
            self.view.record_placement(decision.worker_id, decision.blocks_needed, request.block_hashes)
            if request.handoff is not None:
                self.view.record_prefill(
                    request.handoff.prefill_worker, len(request.prompt_token_ids), request.block_hashes
                )
            metrics.PLACEMENTS.labels(self.pool).inc()
            metrics.QUEUED_SECONDS.labels(self.pool).observe(time.monotonic() - held.arrived)
            metrics.PREFIX_BLOCKS.labels(self.pool, "prompt").inc(len(request.block_hashes))
            metrics.PREFIX_BLOCKS.labels(self.pool, "matched").inc(decision.matched_blocks)
            return True
        if outcome == "changed":
            return False  # the lost worker's log grew meanwhile: read again next round
        metrics.OUTCOMES.labels(self.pool, outcome).inc()
        if outcome == "cancelled":
            await self._settle_ended(request, UsageStatus.CANCELLED, ErrorCode.CANCELLED)
            if request.batch is not None:
                self._answer_cancelled(held)  # it leaves the hold once the answer is out
                return True
        self._finish(held)
        return True

    def _handoff(self, request: InferenceRequest, decode_worker: str, matched_blocks: int) -> Handoff | None:
        """A handoff to the best prefill worker when the split decision says so (dispatcher.disagg).
        A moved request (its prompt holds delivered output) and a batch request prefill where they
        decode."""
        config = self.disaggregation
        decode = self.view.heartbeats.get(decode_worker)
        if config is None or decode is None or request.resume is not None or request.batch is not None:
            return None
        prompt = len(request.prompt_token_ids)
        sides = self.view.prefill_sides(request.block_hashes)
        side = choose_prefill(sides, prompt, time.time(), config, self.rng)
        if side is None:
            metrics.SPLITS.labels(self.pool, "local", "no prefill worker ready").inc()
            return None
        waiting = self.view.waiting(decode_worker)
        case = split_case(prompt, decode, matched_blocks * self.block_size, side, config, waiting)
        verdict = decide_split(case, config)
        metrics.SPLITS.labels(self.pool, "split" if verdict.split else "local", verdict.reason).inc()
        if not verdict.split:
            return None
        return Handoff(id=secrets.token_hex(16), prefill_worker=side.worker_id, wait_s=config.handoff_wait_s)

    async def _prepare_move(self, held: Held) -> int | None:
        """Ready a request taken over from a lost worker for placement, from what its replay log shows
        was delivered (dispatcher.migration): the request whole, or its continuation. Returns how many
        chunks the log held, or None when it needs no placement: it had ended, or cannot move and is
        answered with worker_lost after what its client has."""
        lost = held.taken_over
        assert lost is not None
        log_ = await read_log(self.redis, self.names, lost.request_id)
        move = decide_move(lost, log_, self.max_migrations, self.block_size)
        held.request = move.request
        if move.outcome in ("restarted", "moved"):
            return move.logged  # counted once placed
        await self._count_move(move.outcome)
        if move.outcome == "ended":
            self._finish(held)
            return None
        metrics.OUTCOMES.labels(self.pool, "worker_lost").inc()
        log.warning("request of a lost worker cannot move", request_id=lost.request_id, reason=move.reason)
        prompt = min(move.used_tokens, lost.client_prompt_tokens)
        usage = Usage(prompt_tokens=prompt, completion_tokens=move.used_tokens - prompt)
        await self._settle_ended(lost, UsageStatus.FAILED, ErrorCode.WORKER_LOST, usage)
        message = f"the worker serving the request was lost, and {move.reason}"
        self._answer_soon(
            held, partial(self._answer_error, lost, ErrorCode.WORKER_LOST, message, move.logged)
        )
        return None

    async def _count_move(self, outcome: str) -> None:
        """In this process's metrics, and in Redis for the scaler's dashboard (all dispatchers summed)."""
        metrics.MIGRATIONS.labels(self.pool, outcome).inc()
        with contextlib.suppress(RedisError):
            await self.redis.hincrby(self.names.migrations(self.pool), outcome, 1)

    async def _settle_ended(
        self, request: InferenceRequest, status: UsageStatus, code: str, usage: Usage | None = None
    ) -> None:
        """Settle a request that ends here, with its usage event (written even when it reserved nothing,
        as a batch request that never reached a worker did)."""
        used = 0 if usage is None else usage.total_tokens
        event = usage_event(request, status, usage, time.time(), error_code=code)
        await settle(self.redis, self.names, request.team, request.request_id, used, event, unreserved=True)

    def _answer_cancelled(self, held: Held) -> None:
        """A batch request cancelled before it reached a worker is answered `cancelled`: whoever cancelled
        it waits for one answer per request (an interactive one's client has gone)."""
        message = "the request was cancelled before it started"
        self._answer_soon(held, partial(self._answer_error, held.request, ErrorCode.CANCELLED, message))

    def _end_failed(self, held: Held, exc: Exception) -> None:
        """End a request whose placement raised: it leaves the hold and is answered with an error (its
        record's offset closes once the answer is out, or once answering it failed too)."""
        item_failed("dispatcher.placement")
        metrics.OUTCOMES.labels(self.pool, "failed").inc()
        log.error(
            "request failed placement; ended alone", request_id=held.request.request_id,
            error=type(exc).__name__, exc_info=exc,
        )  # fmt: skip
        request = held.request
        message = f"the request could not be placed ({type(exc).__name__})"

        async def answer() -> None:
            try:
                await self._settle_ended(request, UsageStatus.FAILED, ErrorCode.BAD_REQUEST)
            except Exception:  # the answer still goes out; the reservation expires on its own
                log.exception("failed request not settled", request_id=request.request_id)
            await self._answer_error(request, ErrorCode.BAD_REQUEST, message)

        self._answer_soon(held, answer)

    def _finish(self, held: Held) -> None:
        """The request leaves the hold; its record no longer holds its partition's commit back."""
        self.hold.remove(held.request.request_id)
        if held.partition is not None and held.offset is not None:
            self.offsets.closed(held.partition, held.offset)

    async def _expire(self) -> None:
        for held in self.hold.expired(time.time()):
            # Settled before it leaves the hold: if Redis fails here, the next round tries again.
            try:
                await self._settle_ended(held.request, UsageStatus.FAILED, ErrorCode.TIMEOUT)
            except (RedisError, BusUnavailable):
                raise
            except Exception as exc:  # this request's alone
                self._end_failed(held, exc)
                continue
            late = "no worker could take the request in time"
            resume = held.request.resume  # a moved request's error follows what its client has
            seq = 0 if resume is None else resume.next_seq
            self._answer_soon(held, partial(self._answer_error, held.request, ErrorCode.TIMEOUT, late, seq))
            metrics.OUTCOMES.labels(self.pool, "timeout").inc()

    def _answer_soon(self, held: Held, send: Callable[[], Awaitable[object]]) -> None:
        """The request leaves the hold now and is answered in the background; its record's offset stays
        open until the answer is out. If the broker is unreachable it comes back to the hold."""

        def retry() -> None:
            held.not_before = time.time() + REDIS_PAUSE_S
            self.hold.add(held)

        self.hold.remove(held.request.request_id)
        self.in_flight.deliver(send, done=lambda: self._finish(held), retry=retry)

    # acknowledge
    async def _acknowledge(self) -> None:
        offsets = self.offsets.to_commit()
        if not offsets:
            return
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        offsets = {p: o for p, o in offsets.items() if p in assigned}
        if offsets:
            await self.consumer.commit({TopicPartition(*p): o for p, o in offsets.items()})
            self.offsets.committed(offsets)

    def _flow_control(self) -> None:
        """Each class has its own bound in the hold, so a batch flood never pauses interactive partitions."""
        bounds = (
            (self.topic, Priority.INTERACTIVE, self.settings.hold_capacity),
            (self.batch_topic, Priority.BATCH, self.settings.batch_hold_capacity),
        )
        for topic, priority, capacity in bounds:
            assigned = [tp for tp in self.consumer.assignment() if tp.topic == topic]
            # Admissions and answers under way hold their records' offsets too: they count against the bound.
            size = self.hold.size(priority) + (len(self.in_flight) if priority is Priority.BATCH else 0)
            if topic not in self._paused and size >= capacity:
                self.consumer.pause(*assigned)
                self._paused.add(topic)
                log.warning("hold full; pausing partitions", topic=topic, held=size)
            elif topic in self._paused and size <= capacity * 3 // 4:
                self.consumer.resume(*assigned)
                self._paused.discard(topic)
                log.info("resuming partitions", topic=topic, held=size)
        metrics.PAUSED.labels(self.pool).set(1 if self.topic in self._paused else 0)

    def _export_hold(self) -> None:
        for priority in Priority:
            metrics.HOLD_SIZE.labels(self.pool, priority.value).set(self.hold.size(priority))
        held = self.hold.held_by_team()
        for team in self._teams_seen - held.keys():
            metrics.TEAM_HELD.labels(self.pool, team).set(0)
        for team, count in held.items():
            metrics.TEAM_HELD.labels(self.pool, team).set(count)
        self._teams_seen |= held.keys()

    def revoked(self, partitions: set[tuple[str, int]]) -> None:
        """Partitions moved to another member: forget what was held from them; it is redelivered there."""
        for held in self.hold.from_partitions(partitions):
            self.hold.remove(held.request.request_id)
        self.offsets.forget(partitions)

    # background: worker view, prefix index, cancellations
    async def _view_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                gone = await self.view.refresh()
                # Right after Redis comes back, heartbeats that lapsed while it was away are being
                # renewed: a worker is taken for lost only once it had a whole grace period to beat.
                if time.monotonic() - self._redis_failed_at >= self.settings.recovery_grace_s:
                    for worker_id in gone:
                        await self._recover(worker_id)
            except RedisError as exc:
                self._redis_failed_at = time.monotonic()
                log.warning("worker view refresh failed", error=str(exc))
            await asyncio.sleep(self.settings.view_refresh_s)

    async def _recover(self, worker_id: str) -> None:
        requests = await take_over(self.redis, self.names, self.pool, worker_id)
        # An inbox a restarted worker handed over holds requests placed on that worker's own id.
        owner = await self.redis.get(self.names.left_by(worker_id)) if requests else None
        placed_on = owner.decode() if isinstance(owner, bytes) else worker_id
        for request in requests or ():
            held = Held(request, None, None, time.monotonic(), moved_from=placed_on, taken_over=request)
            # Before it joins the hold: one that ended or cannot move is answered now, and a
            # continuation is bound by its deadline only, not by the start-by time of a queued request.
            try:
                to_place = await self._prepare_move(held) is not None
            except RedisError:  # its inbox entry is gone: it is held, and prepared again at its turn
                to_place = True
            if to_place and self.hold.add(held):
                metrics.RECOVERED.labels(self.pool).inc()

    async def _weights_loop(self, stop: asyncio.Event) -> None:
        """Keep the hold's team weights to the team records, re-read every few seconds."""
        while not stop.is_set():
            teams = sorted(self.hold.teams())
            if teams:
                try:
                    raw = await mget_any(self.redis, [self.names.team(t) for t in teams])
                    self.hold.set_weights(team_weights(teams, raw))
                except RedisError as exc:
                    log.warning("team weights not read", error=str(exc))
            await asyncio.sleep(self.settings.weights_refresh_s)

    async def _kv_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if not await self.view.read_kv_events(block_ms=100):
                    await asyncio.sleep(0.05)
            except RedisError as exc:
                log.warning("prefix index read failed", error=str(exc))
                await asyncio.sleep(0.5)

    def _on_heartbeat(self, data: bytes) -> None:
        """Heartbeats pushed by workers, so a new or recovered worker is seen before the next re-read."""
        with contextlib.suppress(SchemaError):
            self.view.on_heartbeat(decode(Heartbeat, data))

    async def _on_cancel(self, data: bytes) -> None:
        try:
            notice = decode(CancelNotice, data)
        except SchemaError:
            return
        held = self.hold.remove(notice.request_id)
        if held is not None:
            metrics.OUTCOMES.labels(self.pool, "cancelled").inc()
            await self._settle_ended(held.request, UsageStatus.CANCELLED, ErrorCode.CANCELLED)
            if held.request.batch is not None:
                self._answer_cancelled(held)  # its offset closes once the answer is out
            elif held.partition is not None and held.offset is not None:
                self.offsets.closed(held.partition, held.offset)

    # answers
    async def _answer_error(self, request: InferenceRequest, code: str, message: str, seq: int = 0) -> None:
        """The request's terminal error: on its reply topic (batch), or logged and streamed as chunk
        `seq`, the one after what its log holds (0 for a request that never started)."""
        if request.batch is not None:
            await self.batch.answer_error(request, code, message)
            return
        chunk = ErrorChunk(request_id=request.request_id, seq=seq, code=code, message=message)
        ttl = log_ttl_ms(request.deadline, time.time(), True, request.keep_log_s)
        keys, args = chunk_args(self.names, chunk, encode(chunk), "", ttl, self.settings.stream_publish)
        await self._log_chunk(keys=keys, args=args)
