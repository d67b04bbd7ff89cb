"""Batch through Kafka: the submission a submitter produces to batch.<pool>, and the answer line it gets back.

A submission carries an OpenAI request body; its answer has the shape of a line of OpenAI's batch output
file (`id`, `custom_id`, `response`, `error`), plus the submitter's `request_id` and the schema version.
docs/batch.md documents both for submitters using any Kafka client.

Pure: validation, naming and answer building. Reading and producing live in the services.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from queue_schemas.boundary import InputRefused, load_untrusted
from queue_schemas.messages import (
    SCHEMA_VERSION,
    InferenceRequest,
    Message,
    Name,
)
from queue_schemas.names import Names

TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}$")
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._\-]{1,249}$")
SUBMISSION_ID = r"^[A-Za-z0-9_.:\-]+$"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_COMPLETION_WINDOW_S = 24 * 3600.0


class BatchSubmission(Message):
    """One request of a batch, as produced to batch.<pool>."""

    request_id: str = Field(
        min_length=1, max_length=128, pattern=SUBMISSION_ID, description="unique within the team"
    )
    custom_id: str | None = Field(default=None, max_length=512, description="echoed in the answer")
    team: Name
    reply_topic: str | None = Field(default=None, description="default: <prefix>.results.<team>")
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/completions"] = "/v1/chat/completions"
    body: dict[str, Any]
    prompt_token_ids: tuple[int, ...] | None = Field(
        default=None, min_length=1, description="the prompt already tokenized with the pool's tokenizer"
    )
    completion_window_s: float | None = Field(
        default=None, gt=0, le=7 * 24 * 3600, description="how long it may wait for a worker"
    )
    submitted_at: float | None = None
    key_id: str | None = Field(
        default=None,
        max_length=64,
        description="the API key that created the batch, for usage records; read only from lines that "
        "sluice's /v1/batches signed (a team's own lines are recorded under their signing key)",
    )


class AnswerResponse(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    status_code: int
    request_id: str
    body: dict[str, Any]


class AnswerError(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str
    message: str


class BatchAnswer(Message):
    """The one answer to a submission, produced to its reply topic with the request id as the key.

    Exactly one of `response` (HTTP status and body: a completion, or an OpenAI error body) and `error`
    (a failure that is not an HTTP answer: timeout, engine error) is set.
    """

    id: str
    request_id: str | None
    custom_id: str | None
    response: AnswerResponse | None = None
    error: AnswerError | None = None

    def output_line(self) -> dict[str, Any]:
        """The line of an OpenAI batch output file."""
        return {
            "id": self.id,
            "custom_id": self.custom_id,
            "response": None if self.response is None else self.response.model_dump(),
            "error": None if self.error is None else self.error.model_dump(),
        }

    @property
    def succeeded(self) -> bool:
        return self.response is not None and self.response.status_code == 200


class Envelope(BaseModel):
    """What can be read of a submission even when the rest of it is invalid: where and how to answer."""

    model_config = ConfigDict(frozen=True)

    reply_topic: str
    request_id: str | None
    custom_id: str | None
    team: str | None


def internal_request_id(team: str, submission_id: str) -> str:
    """The bus request id of a submission: the same for every delivery of it, so redeliveries and
    resubmissions are recognised, and distinct between teams, so one team cannot collide with another."""
    digest = hashlib.sha256(f"{team}\x00{submission_id}".encode()).hexdigest()
    return f"b{digest[:39]}"


def answer_id(request_id: str) -> str:
    return f"batch_req_{request_id}"


def reply_topic_problem(topic: str, names: Names, pools: tuple[str, ...]) -> str | None:
    """Why `topic` cannot carry answers, or None. sluice's own request topics are refused."""
    if not TOPIC_NAME.match(topic):
        return f"reply topic {topic[:300]!r} is not a valid Kafka topic name"
    reserved = {names.deadletter_topic()}
    for pool in pools:
        reserved |= {names.requests_topic(pool), names.batch_topic(pool)}
    if topic in reserved:
        return f"reply topic {topic!r} is one of sluice's own topics"
    return None


def reply_topic_owned(topic: str, team: str, names: Names, reply_prefixes: tuple[str, ...]) -> bool:
    """Whether `team` may have answers sent to `topic`: its results topic, or a topic under a prefix
    registered for it that is not one of the deployment's own topics (another team's results, the
    answers of /v1/batches, usage)."""
    if topic == names.results_topic(team):
        return True
    if topic.startswith(names.prefix + "."):  # the deployment's own topics: other teams', internal ones
        return False
    return any(prefix and topic.startswith(prefix) for prefix in reply_prefixes)


def load_record(raw: bytes) -> dict[str, Any] | str:
    """A raw submission's JSON object, parsed once for envelope and submission and checked at the input
    boundary; or why it is not one."""
    try:
        obj = load_untrusted(raw)
    except InputRefused as exc:
        return exc.message
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    return obj


def read_envelope(obj: dict[str, Any], names: Names, pools: tuple[str, ...]) -> Envelope | str:
    """Where to answer a submission, or why there is no usable reply topic (for the dead-letter topic)."""
    team = obj.get("team")
    topic = obj.get("reply_topic")
    team_ok = isinstance(team, str) and TEAM_NAME.match(team) is not None
    if topic is None and team_ok:
        topic = names.results_topic(str(team))
    if not isinstance(topic, str):
        return "no reply_topic, and no valid team to default it from"
    problem = reply_topic_problem(topic, names, pools)
    if problem is not None:
        return problem
    rid, cid = obj.get("request_id"), obj.get("custom_id")
    return Envelope(
        reply_topic=topic,
        request_id=rid[:128] if isinstance(rid, str) else None,
        custom_id=cid[:512] if isinstance(cid, str) else None,
        team=str(team) if team_ok else None,
    )


def parse_submission(obj: dict[str, Any]) -> BatchSubmission | str:
    """The submission, or a readable reason it is invalid."""
    if obj.get("v") != SCHEMA_VERSION:
        return f"unsupported schema version {obj.get('v')!r} (this build speaks v{SCHEMA_VERSION})"
    try:
        return BatchSubmission.model_validate(obj)
    except ValidationError as exc:
        parts = [
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()[:5]
        ]
        return "invalid submission: " + "; ".join(parts)


def http_answer(
    envelope_id: str, request_id: str | None, custom_id: str | None, status: int, body: dict[str, Any]
) -> BatchAnswer:
    """An answer that is an HTTP response: a completion (200) or a refused request (4xx with its error)."""
    return BatchAnswer(
        id=answer_id(envelope_id),
        request_id=request_id,
        custom_id=custom_id,
        response=AnswerResponse(status_code=status, request_id=envelope_id, body=body),
    )


def failure_answer(
    envelope_id: str, request_id: str | None, custom_id: str | None, code: str, message: str
) -> BatchAnswer:
    """An answer for a request that was accepted but could not be completed."""
    return BatchAnswer(
        id=answer_id(envelope_id),
        request_id=request_id,
        custom_id=custom_id,
        error=AnswerError(code=code, message=message),
    )


def failed_answer(request: InferenceRequest, code: str, message: str) -> BatchAnswer:
    ticket = request.batch
    assert ticket is not None, "only batch requests are answered on Kafka"
    return failure_answer(request.request_id, ticket.request_id, ticket.custom_id, code, message)
