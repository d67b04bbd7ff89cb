"""Running one request on the engine: its start check and first chunk in one script, its chunks
streamed (or gathered, for a batch request), its quota settled, and its failure ended alone."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import structlog
from redis.exceptions import RedisError

from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import EarlyStart, EngineError, RequestFailed
from gpu_workers.handoff import KvTransfer
from gpu_workers.metrics import TEAM_TOKENS
from gpu_workers.output import Moved, RequestOutput, stamped
from gpu_workers.parts import LEAVE, REQUEST_FAULT, REQUEST_ITEMS, WorkerParts, log
from gpu_workers.starting import STARTED_MARK_TTL_MS, start_refusal
from gpu_workers.tracing import RequestSpans
from plumbing import tracing
from plumbing.clients import BusUnavailable
from plumbing.health import item_failed
from plumbing.protocol.request import Begun, begin_keys
from plumbing.quota import settle
from plumbing.replay import log_field, log_ttl_ms
from plumbing.retry import through_outage
from plumbing.window import flush_window_s
from queue_schemas.codec import encode
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    InferenceRequest,
    TokenChunk,
    Usage,
)
from queue_schemas.usage import UsageEvent, UsageStatus, usage_event


class Serving(WorkerParts):
    def _flush_window(self) -> float:
        """The coalescing window now, with the requests this worker is running (its request tasks)."""
        s = self.settings
        return flush_window_s(
            s.flush_interval_ms / 1000, s.flush_max_ms / 1000, len(self._tasks), s.flush_knee_streams
        )

    async def _serve(self, request: InferenceRequest, entry_id: bytes) -> None:
        """Run one request to its terminal chunk, settle the team's quota, then acknowledge the entry."""
        out = RequestOutput(
            request, self.publisher, self.answers, self.names, self.settings.worker_id,
            self.settings.bus_outage_s, self.settings.stream_publish,
        )  # fmt: skip
        coalescer = ChunkCoalescer(
            request.request_id, self.settings.worker_id, self._flush_window, request.resume
        )
        started = False
        pieces: EarlyStart | None = None
        loaded: KvTransfer | None = None
        spans = RequestSpans(request, entry_id, self.settings.worker_id, out.timing.began or time.time())
        coalescer.traceparent = spans.traceparent
        if spans.traceparent is not None:  # this task's log lines carry the request's trace id
            structlog.contextvars.bind_contextvars(trace_id=tracing.trace_id_of(spans.traceparent))
        outcome = "failed"

        def produced() -> bool:
            """Whether the engine gave output: a request stopped after that is charged what it used."""
            return started or coalescer.completion_tokens > 0

        try:
            refusal = start_refusal(request, time.time())
            if refusal is None and request.handoff is not None and self.handoffs is not None:
                loaded = (await self.handoffs.await_kv(request)).kv  # None: prefilled here
                spans.kv_loaded(time.time())
                if loaded is None:
                    self.first_tokens.prefilled_here(
                        request.request_id, len(request.prompt_token_ids), time.time()
                    )
            if refusal is None:
                # Prefill starts at once; the start check goes out with the first chunk.
                with tracing.current(spans.span):  # the engine continues the trace from here
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
                outcome = str(refusal[0])
                await self._fail(out, coalescer, started, *refusal)
            else:
                assert pieces is not None
                started = True
                last = time.monotonic()
                async for piece in pieces:
                    now = time.monotonic()
                    self.first_tokens.tokens_after(now - last, piece.num_tokens)
                    last = now
                    await self._deliver(out, coalescer.add(piece, now))
                outcome = "ok"
        except EngineError as exc:
            outcome = "engine_error"
            if self.engine.failure() is not None:
                # The engine is dead, not this request: the worker fails, and a dispatcher moves the
                # request to another worker from what was delivered.
                log.warning("engine died; request left for another worker", request_id=request.request_id)
                return
            log.error("engine failed on a request", request_id=request.request_id, error=str(exc))
            await self._fail(out, coalescer, produced(), ErrorCode.ENGINE_ERROR, str(exc))
        except Moved:
            outcome = "moved"
            log.warning("request moved to another worker; stopping here", request_id=request.request_id)
        except asyncio.CancelledError:
            outcome = "left" if self._abort_reason is LEAVE else str(self._abort_reason[0])
            if self._abort_reason is LEAVE:
                # This worker is going away: the entry stays, and a dispatcher moves the request on from
                # what its log shows was delivered (its quota reservation stays for whoever finishes it).
                log.warning("request left for another worker", request_id=request.request_id)
                return
            await self._fail(out, coalescer, produced(), *self._abort_reason)
        except (RedisError, BusUnavailable) as exc:
            outcome = "bus_lost"
            log.error("lost the bus while answering", request_id=request.request_id, error=str(exc))
            return  # not acknowledged: the entry stays pending for recovery
        except Exception as exc:  # a fault of this request alone: it ends, the worker goes on
            outcome = "failed"
            log.error(
                "request failed", request_id=request.request_id, error=type(exc).__name__, exc_info=True
            )
            if not await self._fail_alone(out, coalescer, produced()):
                return  # the entry stays pending for recovery
        finally:
            usage = out.usage
            cached = None if usage is None else usage.cached_tokens
            spans.finish(out.timing, outcome, coalescer.completion_tokens, cached)
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
            first_at = time.time()
            out.timing = replace(out.timing, first_token=first_at)
            self.first_tokens.first_token(request.request_id, first_at)
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
            chunk = chunk.model_copy(update={"ended_at": time.time()})
            out.usage = chunk.usage
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
            first = stamped(first, request.epoch)
            field = log_field(request.epoch, first.seq)
            args += [self.settings.stream_publish, encode(first), field, ttl]
        outcome = await self._begin_script(keys=keys, args=args)
        return Begun(outcome.decode() if isinstance(outcome, bytes) else str(outcome))

    async def _settle(self, request: InferenceRequest, used_tokens: int, usage: UsageEvent) -> None:
        """Settle the team's quota and write the request's usage record, through a Redis outage of up to
        the bus's outage window, as its chunks are (a settle is written once per request, so a try whose
        reply was lost is harmless to repeat)."""
        TEAM_TOKENS.labels(request.pool, request.team).inc(used_tokens)
        rid = request.request_id

        def retrying(exc: BaseException) -> None:
            log.warning("quota not settled; retrying", request_id=rid, error=str(exc))

        try:
            await through_outage(
                lambda: settle(self.redis, self.names, request.team, rid, used_tokens, usage),
                self.settings.bus_outage_s,
                retrying,
            )
        except (RedisError, OSError) as exc:
            log.warning("quota not settled", request_id=rid, error=str(exc))

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
