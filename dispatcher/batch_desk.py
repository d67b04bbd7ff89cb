"""The dispatcher's batch desk: takes submissions from batch.<pool>, reserves quota when a worker is found,
and answers on reply topics whatever does not reach a worker.

Every submission ends one of three ways: held (and later placed, or answered with a timeout), answered at
once with the error a refused HTTP request would get, or sent to the dead-letter topic when it names no
usable reply topic.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import ConsumerRecord

from dispatcher import metrics
from dispatcher.batch_intake import batch_request, parse_batch_body, prompt_ids
from dispatcher.hold import Held
from queue_schemas.answers import AnswerSink
from queue_schemas.api_errors import ApiError, InsufficientQuota, InvalidRequest, RateLimited
from queue_schemas.batch import (
    BatchAnswer,
    Envelope,
    failed_answer,
    http_answer,
    internal_request_id,
    load_record,
    parse_submission,
    read_envelope,
)
from queue_schemas.config import PoolConfig
from queue_schemas.messages import InferenceRequest
from queue_schemas.names import Names
from queue_schemas.quota import TeamRecord
from queue_schemas.quota_gate import QuotaGate
from queue_schemas.structured import xgrammar_check
from queue_schemas.tokenizer import PromptTokenizer

log = structlog.get_logger("sluice.dispatcher.batch")

DeadLetterFn = Callable[[ConsumerRecord[Any, Any], str], Awaitable[None]]
QUOTA_STORE_RETRY_S = 1.0
TEAM_CACHE_S = 10.0


class Reserve(Enum):
    GO = "go"
    WAIT = "wait"  # rate limited: try again at held.not_before
    REFUSED = "refused"  # answered with the 429; the request leaves the hold


class BatchDesk:
    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        pool: PoolConfig,
        tokenizer: PromptTokenizer,
        answers: AnswerSink,
        dead_letter: DeadLetterFn,
    ) -> None:
        self.redis = redis
        self.names = names
        self.pool = pool
        self.tokenizer = tokenizer
        self.answers = answers
        self.quota = QuotaGate(redis, names)
        self._dead_letter = dead_letter
        self._compile_check = xgrammar_check if pool.engine == "vllm" else None
        self._teams: dict[str, float] = {}  # known team -> until when (monotonic) that is trusted

    async def admit(self, record: ConsumerRecord[Any, Any]) -> InferenceRequest | None:
        """The request to hold, or None when the submission was answered, dead-lettered or is a duplicate."""
        obj = load_record(record.value or b"")
        envelope = obj if isinstance(obj, str) else read_envelope(obj, self.names, (self.pool.name,))
        if isinstance(envelope, str):
            await self._dead_letter(record, envelope)
            return None
        assert not isinstance(obj, str)
        sub = parse_submission(obj)
        if isinstance(sub, str):
            await self._refuse(envelope, record, InvalidRequest(sub, code="invalid_submission"))
            return None
        rid = internal_request_id(sub.team, sub.request_id)
        if await self._seen(rid):
            metrics.OUTCOMES.labels(self.pool.name, "duplicate").inc()
            return None
        try:
            if not await self._team_exists(sub.team):
                raise InvalidRequest(f"Unknown team '{sub.team}'.", param="team", code="unknown_team")
            parsed = parse_batch_body(sub, self.pool, self._compile_check)
            ids = await prompt_ids(sub, parsed, self.tokenizer)
            return batch_request(sub, envelope.reply_topic, self.pool, parsed, ids, time.time())
        except ApiError as err:
            await self._refuse(envelope, record, err)
            return None

    async def _team_exists(self, team: str) -> bool:
        """Whether the team has a record; a known team is remembered for TEAM_CACHE_S."""
        now = time.monotonic()
        if self._teams.get(team, 0.0) > now:
            return True
        if not await self.redis.exists(self.names.team(team)):
            return False
        self._teams[team] = now + TEAM_CACHE_S
        return True

    async def _seen(self, rid: str) -> bool:
        """Placed already (a redelivery) or answered already (a resubmission)."""
        return bool(await self.redis.exists(self.names.placement(rid), self.names.answered(rid)))

    async def reserve(self, held: Held) -> Reserve:
        """Reserve the team's quota for a batch request about to be placed (ingress did it for the rest)."""
        request = held.request
        if held.reserved or held.moved_from is not None or request.batch is None:
            return Reserve.GO
        now = time.time()
        try:
            raw = await self.redis.get(self.names.team(request.team))
            limits = (
                TeamRecord.model_validate_json(raw).limits if raw else TeamRecord(team=request.team).limits
            )
            cost = len(request.prompt_token_ids) + request.sampling.max_tokens
            await self.quota.reserve(request.team, limits, request.request_id, cost, request.deadline - now)
        except RateLimited as err:
            held.not_before = now + int(err.headers.get("retry-after-ms", "1000")) / 1000
            return Reserve.WAIT
        except InsufficientQuota as err:
            await self.answer(request, http_answer(
                request.request_id, request.batch.request_id, request.batch.custom_id, err.status, err.body()
            ))  # fmt: skip
            metrics.OUTCOMES.labels(self.pool.name, "quota").inc()
            return Reserve.REFUSED
        except ApiError:  # the quota store is unreachable: try again shortly
            held.not_before = now + QUOTA_STORE_RETRY_S
            return Reserve.WAIT
        held.reserved = True
        return Reserve.GO

    async def answer_error(self, request: InferenceRequest, code: str, message: str) -> None:
        await self.answer(request, failed_answer(request, code, message))

    async def answer(self, request: InferenceRequest, answer: BatchAnswer) -> None:
        assert request.reply_topic is not None
        await self.answers.deliver(request.reply_topic, request.request_id, answer)

    async def _refuse(self, envelope: Envelope, record: ConsumerRecord[Any, Any], err: ApiError) -> None:
        """Answer a submission that cannot be served with the HTTP error it would have got."""
        key = (
            internal_request_id(envelope.team, envelope.request_id)
            if envelope.team and envelope.request_id
            else f"{record.topic}-{record.partition}-{record.offset}"
        )
        answer = http_answer(key, envelope.request_id, envelope.custom_id, err.status, err.body())
        try:
            await self.answers.deliver(envelope.reply_topic, key, answer)
        except (
            Exception
        ) as exc:  # the reply topic cannot take it: the submission goes to the dead-letter topic
            await self._dead_letter(record, f"{err.message} (and its answer could not be delivered: {exc})")
            return
        metrics.OUTCOMES.labels(self.pool.name, "refused").inc()
        log.info("batch submission refused", reason=err.message, offset=record.offset)
