"""Ending a request the dispatcher holds: settling it, answering it (an error chunk, or a batch answer),
its record's offset closing once that is out; expiry, cancellation, and a request whose placement
raised, ended alone."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial

import structlog
from redis.exceptions import RedisError

from dispatcher import metrics
from dispatcher.hold import Held
from dispatcher.state import REDIS_PAUSE_S, DispatcherState
from plumbing.clients import BusUnavailable
from plumbing.health import item_failed
from plumbing.protocol.request import control_chunk_args
from plumbing.quota import settle
from plumbing.replay import log_ttl_ms
from queue_schemas.codec import decode, encode
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import (
    CancelNotice,
    ErrorChunk,
    InferenceRequest,
    Usage,
)
from queue_schemas.usage import UsageStatus, usage_event

log = structlog.get_logger("sluice.dispatcher")


class Ending(DispatcherState):
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

    async def _shed(self, held: Held, reason: str) -> None:
        """Refuse a sheddable request no worker can serve within its TTFT SLO: settled first, charged
        nothing (if Redis fails here, it stays held and the next round tries again), then it leaves the
        hold and its client gets `overloaded` (HTTP 429) naming why."""
        request = held.request
        await self._settle_ended(request, UsageStatus.FAILED, ErrorCode.OVERLOADED)
        if request.request_id not in self.hold:
            return  # cancelled meanwhile: it left the hold, and its cancel answered it
        metrics.OUTCOMES.labels(self.pool, "shed").inc()
        self._answer_soon(held, partial(self._answer_error, request, ErrorCode.OVERLOADED, reason))

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

    async def _answer_error(self, request: InferenceRequest, code: str, message: str, seq: int = 0) -> None:
        """The request's terminal error: on its reply topic (batch), or logged and streamed as chunk
        `seq`, the one after what its log holds (0 for a request that never started)."""
        if request.batch is not None:
            await self.batch.answer_error(request, code, message)
            return
        chunk = ErrorChunk(request_id=request.request_id, seq=seq, code=code, message=message)
        ttl = log_ttl_ms(request.deadline, time.time(), True, request.keep_log_s)
        keys, args = control_chunk_args(self.names, chunk, encode(chunk), ttl, self.settings.stream_publish)
        await self._log_chunk(keys=keys, args=args)

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
