"""Everything a request handler needs, built once in the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress.auth import Authenticator
from ingress.batches.object_store import ObjectStore
from ingress.pool_gate import PoolGate
from ingress.responses.store import ResponseStore
from ingress.resume import StreamStore, cancel_after_grace
from ingress.settings import IngressSettings
from ingress.streams import StreamHub
from ingress.tracing import before_send
from ingress.upload_slots import UploadSlots
from openai_api.admission import partition_key
from openai_api.checks import CheckRunner
from openai_api.errors import ServiceUnavailable
from openai_api.quota_gate import QuotaGate
from openai_api.tokenizer import PromptTokenizer
from plumbing import tracing
from plumbing.health import Liveness
from plumbing.protocol.request import cancel
from plumbing.quota import settle
from plumbing.replay import LOG_AFTER_END_MS, LogState, read_log, read_log_state
from queue_schemas.codec import encode
from queue_schemas.config import SluiceConfig
from queue_schemas.messages import InferenceRequest, StreamEvent

log = structlog.get_logger("sluice.ingress")


@dataclass
class IngressContext:
    settings: IngressSettings
    pools: SluiceConfig
    tokenizers: dict[str, PromptTokenizer]
    redis: aioredis.Redis
    hub: StreamHub
    producer: AIOKafkaProducer
    auth: Authenticator
    quota: QuotaGate
    pool_gate: PoolGate
    files: ObjectStore
    responses: ResponseStore
    checks: CheckRunner = field(default_factory=CheckRunner)  # schema checks, after the quota gate
    background: set[asyncio.Task[None]] = field(default_factory=set)
    liveness: Liveness = field(default_factory=Liveness)  # the process's background loops, for /healthz
    uploads: UploadSlots = field(default_factory=UploadSlots)  # /v1/files uploads in progress, per team

    async def read_log(self, request_id: str, from_seq: int) -> list[StreamEvent]:
        """The request's replay log from `from_seq` on."""
        return await read_log(self.redis, self.settings.names, request_id, from_seq)

    async def read_tail(self, request_id: str, from_seq: int) -> LogState:
        """The request's replay log from `from_seq` on and its moves, to fill a gap in its stream."""
        return await read_log_state(self.redis, self.settings.names, request_id, from_seq)

    async def release(self, team: str, request_id: str) -> None:
        """Give back a reservation for a request that never reached the queue."""
        try:
            await settle(self.redis, self.settings.names, team, request_id, 0)
        except RedisError as exc:
            log.warning("reservation not released", request_id=request_id, error=str(exc))

    async def publish(self, request: InferenceRequest) -> None:
        topic = self.settings.names.requests_topic(request.pool)
        request, headers, span = before_send(request, topic)
        error: str | None = "not sent"
        try:
            await self.producer.send_and_wait(
                topic, encode(request), key=partition_key(request), headers=headers or None
            )
            error = None
        except KafkaError as exc:
            error = type(exc).__name__
            raise ServiceUnavailable("The request queue is unreachable; retry shortly.") from exc
        finally:
            tracing.end(span, error=error)

    @property
    def streams(self) -> StreamStore:
        return StreamStore(self.redis, self.settings.names)

    def leave(self, request_id: str, pool: str) -> None:
        """A stream's reader went away before the end: the request is cancelled after its pool's grace
        period if no reader is connected then and none came back meanwhile (ingress.resume)."""
        config = next((p for p in self.pools.pools if p.name == pool), None)
        grace = 0.0 if config is None else config.resume_grace_s
        if grace <= 0:
            self.cancel_soon(request_id, "client disconnected")
            return
        task = asyncio.create_task(self._cancel_unless_back(request_id, grace))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel_unless_back(self, request_id: str, grace_s: float) -> None:
        epoch = None
        try:
            epoch = await self.streams.leave(request_id)
        except RedisError as exc:
            log.warning("stream reader not counted out", request_id=request_id, error=str(exc))
        await asyncio.sleep(grace_s)
        if epoch is not None:
            try:
                live, now = await self.streams.readers(request_id)
            except RedisError as exc:
                log.warning("stream readers not read; cancelling", request_id=request_id, error=str(exc))
            else:
                if not cancel_after_grace(live, now, epoch):
                    return  # a reader is connected, or came back and left again (its own timer runs)
        await self._cancel(request_id, f"client disconnected and did not come back in {grace_s:g} s")
        with contextlib.suppress(RedisError):
            await self.streams.ended(request_id, LOG_AFTER_END_MS)

    def stream_ended(self, request_id: str) -> None:
        """A stream was read to its end: its record goes when its log does (detached, best effort)."""

        async def shorten() -> None:
            with contextlib.suppress(RedisError):
                await self.streams.ended(request_id, LOG_AFTER_END_MS)

        task = asyncio.create_task(shorten())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def cancel_soon(self, request_id: str, reason: str) -> None:
        """Tell dispatchers and workers to drop the request; detached, so a dying handler still sends it."""
        task = asyncio.create_task(self._cancel(request_id, reason))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                cancel(pipe, self.settings.names, request_id, reason, time.time())
                await pipe.execute()
        except RedisError as exc:
            log.warning("cancel notice not sent", request_id=request_id, error=str(exc))
