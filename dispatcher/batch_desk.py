"""The dispatcher's batch desk: takes submissions from batch.<pool>, reserves quota when a worker is found,
and answers on reply topics whatever does not reach a worker.

Every submission ends one of three ways: held (and later placed, or answered with a timeout), answered at
once with the error a refused HTTP request would get, or sent to the dead-letter topic when it names no
usable reply topic.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import ConsumerRecord
from redis.exceptions import RedisError

from dispatcher import metrics
from dispatcher.batch_intake import batch_request, parse_batch_body, plan_batch_output, prompt_ids
from dispatcher.hold import Held
from openai_api.checks import CheckRunner
from openai_api.errors import ApiError, InsufficientQuota, InvalidRequest, RateLimited
from openai_api.openai_types import ChatCompletionRequest
from openai_api.quota_gate import QuotaGate, day_budget_left
from openai_api.structured import checked_param, xgrammar_check
from openai_api.tokenizer import PromptTokenizer
from plumbing.answers import AnswerSink, Delivery
from plumbing.protocol.request import served_already
from plumbing.quota import settle
from queue_schemas.batch import (
    TEAM_NAME,
    BatchAnswer,
    Envelope,
    failed_answer,
    http_answer,
    internal_request_id,
    load_record,
    parse_submission,
    read_envelope,
    reply_topic_owned,
)
from queue_schemas.config import PoolConfig
from queue_schemas.messages import InferenceRequest
from queue_schemas.names import Names
from queue_schemas.signing import Headers, read_signature, signature_valid
from queue_schemas.teams import TeamRecord
from queue_schemas.usage import UsageStatus, usage_event

log = structlog.get_logger("sluice.dispatcher.batch")

DeadLetterFn = Callable[[ConsumerRecord[Any, Any], str], Awaitable[None]]
QUOTA_STORE_RETRY_S = 1.0
TEAM_CACHE_S = 10.0


@dataclass(frozen=True)
class Refusal:
    """A submission answered with an error, not held: `send` delivers the answer (the caller decides when,
    so a slow reply topic never holds up placement)."""

    send: Callable[[], Awaitable[object]]


class Signer(Enum):
    TEAM = "team"
    SERVICE = "service"


class Reserve(Enum):
    GO = "go"
    WAIT = "wait"  # rate limited: try again at held.not_before


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
        self._compile_check = xgrammar_check if pool.kind.compiles_schemas else None
        self.checks = CheckRunner()
        self._teams: dict[str, tuple[float, TeamRecord]] = {}  # team -> (trusted until, record)

    async def admit(self, record: ConsumerRecord[Any, Any]) -> InferenceRequest | Refusal | None:
        """The request to hold, its refusal to deliver, or None when the submission was dead-lettered or
        is a duplicate.

        The signature is checked before anything else: an unproven record is never answered on a topic
        it names, only dead-lettered. A proven team's answers go only to topics the team owns."""
        raw: bytes = record.value or b""
        obj = load_record(raw)
        if isinstance(obj, str):
            await self._dead_letter(record, obj)
            return None
        signer = await self._signer(obj, raw, record.headers)
        envelope = signer if isinstance(signer, str) else read_envelope(obj, self.names, (self.pool.name,))
        if isinstance(envelope, str):
            await self._dead_letter(record, envelope)
            return None
        assert envelope.team is not None  # the signature proved it
        team = await self._team_record(envelope.team)
        if signer is Signer.SERVICE:  # a line of a /v1/batches batch: its answer goes to the collector
            owned = envelope.reply_topic == self.names.batch_api_answers_topic()
        else:
            owned = team is not None and reply_topic_owned(
                envelope.reply_topic, envelope.team, self.names, team.reply_prefixes
            )
        if team is None or not owned:
            to_team = envelope.model_copy(update={"reply_topic": self.names.results_topic(envelope.team)})
            return self._refusal(to_team, record, _not_allowed(envelope, team))
        sub = parse_submission(obj)
        if isinstance(sub, str):
            return self._refusal(envelope, record, InvalidRequest(sub, code="invalid_submission"))
        rid = internal_request_id(sub.team, sub.request_id)
        if await self._seen(rid):
            metrics.OUTCOMES.labels(self.pool.name, "duplicate").inc()
            return None
        # Before tokenizing and compiling schemas: a team whose day's budget is spent costs no more.
        left = await day_budget_left(self.redis, self.names, sub.team, team.limits)
        if left is not None and left <= 0:
            spent = InsufficientQuota(f"Team '{sub.team}' has spent its daily token budget.")
            return self._refusal(envelope, record, spent)
        try:
            parsed = parse_batch_body(sub, self.pool)
            ids = await prompt_ids(sub, parsed, self.tokenizer)
            if isinstance(parsed.body, ChatCompletionRequest):
                cheap, param = parsed, checked_param(parsed.body)
                parsed = await self.checks.run(
                    lambda: plan_batch_output(sub, cheap, self._compile_check), param
                )
            request = batch_request(sub, envelope.reply_topic, self.pool, parsed, ids, time.time())
            signature = read_signature(record.headers)
            key_id = None if isinstance(signature, str) else signature[0]
            if signer is Signer.SERVICE:
                key_id = sub.key_id  # the API key the ingress authenticated
            return request.model_copy(update={"key_id": key_id})
        except ApiError as err:
            return self._refusal(envelope, record, err)

    async def _signer(self, obj: dict[str, Any], raw: bytes, headers: Headers | None) -> Signer | str:
        """Who proved the record: the team it names (one of the team's keys), or a service that
        authenticated the team itself (an ingress serving /v1/batches); or why the record is unproven."""
        team = obj.get("team")
        if not isinstance(team, str) or TEAM_NAME.match(team) is None:
            return "the record names no valid team"
        signature = read_signature(headers)
        if isinstance(signature, str):
            return signature
        key_id, sig = signature
        signer = Signer.TEAM
        public = await self.redis.hget(self.names.signing_keys(team), key_id)
        if public is None:
            signer, public = Signer.SERVICE, await self.redis.get(self.names.service_signing_key(key_id))
        if public is None:
            return f"signing key {key_id!r} is not registered for team {team!r}"
        if not signature_valid(public, raw, sig):
            return f"the signature does not match the record (key {key_id!r} of team {team!r})"
        return signer

    async def _team_record(self, team: str) -> TeamRecord | None:
        """The team's record, remembered for TEAM_CACHE_S; None when the team has none (refused)."""
        now = time.monotonic()
        cached = self._teams.get(team)
        if cached is not None and cached[0] > now:
            return cached[1]
        raw = await self.redis.get(self.names.team(team))
        if raw is None:
            return None
        try:
            record = TeamRecord.model_validate_json(raw)
        except ValueError:
            log.error("team record is invalid; its submissions are refused", team=team)
            return None
        self._teams[team] = (now + TEAM_CACHE_S, record)
        return record

    async def _seen(self, rid: str) -> bool:
        """Started by the worker it was placed on (a redelivery) or answered (a resubmission)."""
        names = self.names
        owner, started, answered = await self.redis.mget(  # one slot: all the request's keys
            [names.placement(rid), names.started(rid), names.answered(rid)]
        )
        return served_already(owner, started, answered)

    async def reserve(self, held: Held) -> Reserve | Refusal:
        """Reserve the team's quota for a batch request about to be placed (ingress did it for the rest)."""
        request = held.request
        if held.reserved or held.moved_from is not None or request.batch is None:
            return Reserve.GO
        now = time.time()
        try:
            team = await self._team_record(request.team)
            if team is None:
                raise InsufficientQuota(f"Team '{request.team}' has no record, so no quota.")
            limits = team.limits
            cost = len(request.prompt_token_ids) + request.sampling.max_tokens
            await self.quota.reserve(request.team, limits, request.request_id, cost, request.deadline - now)
        except RateLimited as err:
            held.not_before = now + int(err.headers.get("retry-after-ms", "1000")) / 1000
            return Reserve.WAIT
        except InsufficientQuota as err:
            event = usage_event(request, UsageStatus.FAILED, None, now, error_code="insufficient_quota")
            try:
                await settle(
                    self.redis, self.names, request.team, request.request_id, 0, event, unreserved=True
                )
            except RedisError:
                held.not_before = now + QUOTA_STORE_RETRY_S
                return Reserve.WAIT
            answer = http_answer(
                request.request_id, request.batch.request_id, request.batch.custom_id, err.status, err.body()
            )
            metrics.OUTCOMES.labels(self.pool.name, "quota").inc()
            return Refusal(lambda: self.answer(request, answer))
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

    def _refusal(self, envelope: Envelope, record: ConsumerRecord[Any, Any], err: ApiError) -> Refusal:
        """The answer to a submission that cannot be served: the HTTP error it would have got."""
        return Refusal(lambda: self._refuse(envelope, record, err))

    async def _refuse(self, envelope: Envelope, record: ConsumerRecord[Any, Any], err: ApiError) -> None:
        key = (
            internal_request_id(envelope.team, envelope.request_id)
            if envelope.team and envelope.request_id
            else f"{record.topic}-{record.partition}-{record.offset}"
        )
        answer = http_answer(key, envelope.request_id, envelope.custom_id, err.status, err.body())
        delivery = await self.answers.deliver(envelope.reply_topic, key, answer)
        outcome = "refused" if delivery is not Delivery.DEAD_LETTERED else "dead_letter"
        metrics.OUTCOMES.labels(self.pool.name, outcome).inc()
        log.info("batch submission refused", reason=err.message, offset=record.offset)


def _not_allowed(envelope: Envelope, team: TeamRecord | None) -> ApiError:
    if team is None:
        return InvalidRequest(
            f"Team '{envelope.team}' has no record; ask an operator to create it.",
            param="team",
            code="unknown_team",
        )
    return InvalidRequest(
        f"Reply topic '{envelope.reply_topic}' is not one of team '{envelope.team}''s topics.",
        param="reply_topic",
        code="reply_topic_not_owned",
    )
