"""Message models that cross the bus (Kafka topics, Redis streams and channels).

Every message carries the schema version `v`; a consumer rejects versions it does not know
(see queue_schemas.codec) instead of guessing at their meaning.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION: Literal[1] = 1

RequestId = Annotated[str, Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")]
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_\-]*$")]


MAX_KEEP_LOG_S = 7 * 24 * 3600

# A W3C trace context (version 00): the span a message's receiver continues its trace from.
TRACEPARENT_PATTERN = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
Traceparent = Annotated[str, Field(pattern=TRACEPARENT_PATTERN)]


def _unset(value: object) -> bool:
    """An optional field left off the wire when unset, so a message without it is the same bytes as
    before the field existed."""
    return value is None


def _first(value: object) -> bool:
    """A writer epoch left off the wire at 0 (a request never moved), so its chunks are the same bytes
    as before epochs existed."""
    return value == 0


MAX_EPOCH = 1_000_000  # far above any pool's max_migrations

# A request's writer epoch: 0 where it was first placed, one more each time it moved off a lost worker
# (plumbing.replay). Its chunks carry it, and are logged under it.
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]


# A signed 64-bit seed, as engines take it (vLLM's own server caps seeds so).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class Message(BaseModel):
    """Base for wire messages: strict about unknown fields and immutable once built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = SCHEMA_VERSION


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class Tier(StrEnum):
    """An interactive request's service tier (OpenAI's `service_tier`): its place among interactive work."""

    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"


# Bands, lower first: the dispatcher's hold serves them in this order, and the engine's priority (vLLM's
# convention: lower first) follows them, so a request's place is the same before and inside the engine.
ENGINE_PRIORITY = {Tier.PRIORITY: 0, Tier.DEFAULT: 1, Tier.FLEX: 2}
BATCH_ENGINE_PRIORITY = 3
TAG_SPAN = 2**40  # fair tags (weighted tokens) ordered within one band of engine priority


def engine_priority(priority: Priority, tier: Tier) -> int:
    """The band of a request: interactive ones by tier, then batch. Pure."""
    return BATCH_ENGINE_PRIORITY if priority is Priority.BATCH else ENGINE_PRIORITY[tier]


class ReplyMode(StrEnum):
    STREAM = "stream"  # token chunks over the Redis channel stream:<request_id>
    KAFKA = "kafka"  # one BatchAnswer (queue_schemas.batch) on reply_topic


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"  # shown to clients when the answer is a tool call; engines end with stop


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class StructuredOutput(BaseModel):
    """Output the engine must produce: any JSON object, or JSON valid against a schema (guided decoding)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema"]
    schema_text: str | None = Field(default=None, description="the JSON schema, serialized, for json_schema")


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: tuple[str, ...] = ()
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    structured: StructuredOutput | None = None


class BatchTicket(BaseModel):
    """What the worker needs to answer a batch request on Kafka, decided when the dispatcher admitted it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str = Field(description="the submitter's request id")
    custom_id: str | None = None
    kind: Literal["chat", "text"] = "chat"
    call_id: str | None = Field(default=None, description="set when the answer is a tool call")
    function: str | None = Field(default=None, description="the function a forced tool call names")
    auto: bool = False


class Resume(BaseModel):
    """Where a request moved off a lost worker picks up: its output so far is part of the prompt now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=1, description="the client's prompt: the leading part of prompt_token_ids")
    delivered_tokens: int = Field(ge=1, description="output tokens already delivered, after the prompt")
    next_seq: int = Field(ge=1, description="the sequence number of the next chunk")
    text: str = Field(default="", description="the output text delivered so far")
    migrations: int = Field(ge=1, description="how many times the request has moved")
    max_tokens: int = Field(ge=1, description="the client's max_tokens")


KvRole = Literal["both", "prefill", "decode"]
HandoffId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class Handoff(BaseModel):
    """A disaggregated request's prefill, run on another worker first. Set by the dispatcher that places
    the request (whatever a record arrives with is dropped); the id is secret and names the KV the
    prefill worker writes, so only this request loads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: HandoffId
    prefill_worker: Name
    wait_s: float = Field(gt=0, le=600, description="how long the decode worker waits for the KV")


MAX_SLO_MS = 600_000


class PlacementNote(BaseModel):
    """What the placing dispatcher predicted for the request on the worker it chose (plumbing.latency),
    for the worker to compare with its first token. Set by that dispatcher (whatever a record arrives
    with is dropped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    placed_at: float = Field(description="epoch seconds of the placement")
    predicted_ttft_s: float = Field(ge=0, le=86_400, description="the model's TTFT, uncorrected")
    uncached_tokens: int = Field(ge=0, description="prompt tokens the worker was expected to compute")


class InferenceRequest(Message):
    """One admitted request, produced to requests.<pool> (or batch.<pool>)."""

    request_id: RequestId
    pool: Name
    model: str = Field(min_length=1, max_length=256)
    team: Name
    key_id: str | None = Field(
        default=None, max_length=64, description="the API key or signing key that sent it (usage events)"
    )
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    block_hashes: tuple[str, ...] = ()
    cache_salt: str | None = Field(
        default=None,
        max_length=128,
        description="keeps the prompt's cached prefix to its team (vLLM cache_salt)",
    )
    adapter: str | None = Field(
        default=None, min_length=1, max_length=128, description="the LoRA adapter it runs under, by name"
    )
    sampling: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    tier: Tier = Field(default=Tier.DEFAULT, description="service tier within the interactive class")
    fair_tag: int = Field(
        default=0,
        ge=0,
        description="its team's weighted tokens served (the dispatcher's fair order) when it was placed: "
        "among requests of one band the engine serves the lowest first (start-time fair queueing)",
    )
    reply: ReplyMode = ReplyMode.STREAM
    reply_topic: str | None = None
    batch: BatchTicket | None = Field(default=None, description="how to answer, for reply mode kafka")
    created_at: float = Field(description="epoch seconds when ingress admitted the request")
    start_by: float | None = Field(
        default=None, description="epoch seconds by which an engine must have started it; else it times out"
    )
    deadline: float = Field(description="epoch seconds after which the request is abandoned")
    resume: Resume | None = Field(default=None, description="set when the request moved off a lost worker")
    handoff: Handoff | None = Field(
        default=None, description="set by the dispatcher when the prefill runs on another worker first"
    )
    keep_log_s: int = Field(
        default=0,
        ge=0,
        le=MAX_KEEP_LOG_S,
        description="how long past its deadline its replay log is kept (a stored response's events); "
        "0: a couple of minutes after it ends",
    )
    ttft_slo_ms: int | None = Field(
        default=None, gt=0, le=MAX_SLO_MS, description="its time-to-first-token SLO (None: the pool's)"
    )
    tpot_slo_ms: int | None = Field(
        default=None, gt=0, le=MAX_SLO_MS, description="its time-per-output-token SLO (None: the pool's)"
    )
    placement: PlacementNote | None = Field(default=None, description="set by the placing dispatcher")
    epoch: Epoch = Field(
        default=0,
        exclude_if=_first,
        description="the writer epoch its worker writes under (plumbing.replay); set by the placing "
        "dispatcher",
    )
    traceparent: Traceparent | None = Field(
        default=None,
        exclude_if=_unset,
        description="the span its next hop continues the request's trace from",
    )

    @model_validator(mode="after")
    def _kafka_reply_needs_ticket(self) -> InferenceRequest:
        if self.reply is ReplyMode.KAFKA and (self.batch is None or not self.reply_topic):
            raise ValueError("reply mode kafka needs a reply_topic and a batch ticket")
        return self

    @model_validator(mode="after")
    def _resume_fits(self) -> InferenceRequest:
        resume = self.resume
        if resume is not None and (
            resume.prompt_tokens + resume.delivered_tokens != len(self.prompt_token_ids)
            or resume.delivered_tokens + self.sampling.max_tokens != resume.max_tokens
        ):
            raise ValueError("resume does not match the prompt and max_tokens")
        return self

    @property
    def client_prompt_tokens(self) -> int:
        """The prompt the client sent (a moved request's prompt also holds its earlier output)."""
        return len(self.prompt_token_ids) if self.resume is None else self.resume.prompt_tokens

    @property
    def band(self) -> int:
        return engine_priority(self.priority, self.tier)

    @property
    def engine_priority(self) -> int:
        """What the engine orders by (lower first): its band, then its fair tag."""
        return self.band * TAG_SPAN + min(self.fair_tag, TAG_SPAN - 1)

    def start_deadline(self) -> float:
        return self.deadline if self.start_by is None else min(self.start_by, self.deadline)


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenChunk(Message):
    """Coalesced output tokens of one request, in order by seq."""

    kind: Literal["tokens"] = "tokens"
    request_id: RequestId
    seq: int = Field(ge=0)
    text: str
    num_tokens: int = Field(ge=0)
    token_ids: tuple[int, ...] = Field(default=(), description="the tokens of `text`, for migration")
    traceparent: Traceparent | None = Field(
        default=None, exclude_if=_unset, description="the worker's span, on a first chunk"
    )
    epoch: Epoch = Field(default=0, exclude_if=_first, description="its writer's epoch")


class FinalChunk(Message):
    """The last chunk of a successful request: the remaining text, why it ended, and its usage."""

    kind: Literal["final"] = "final"
    request_id: RequestId
    seq: int = Field(ge=0)
    text: str = ""
    num_tokens: int = Field(default=0, ge=0)
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason
    usage: Usage
    worker_id: str
    traceparent: Traceparent | None = Field(
        default=None, exclude_if=_unset, description="the worker's span of the request"
    )
    ended_at: float | None = Field(
        default=None, exclude_if=_unset, description="epoch seconds the worker ended the request"
    )
    epoch: Epoch = Field(default=0, exclude_if=_first, description="its writer's epoch")


class ErrorChunk(Message):
    """The terminal chunk of a request that failed; `code` is one of queue_schemas.errors.ErrorCode."""

    kind: Literal["error"] = "error"
    request_id: RequestId
    seq: int = Field(ge=0)
    code: str
    message: str
    epoch: Epoch | None = Field(
        default=None,
        exclude_if=_unset,
        description="its worker's epoch; None for one written by the control plane (a dispatcher, a "
        "cancel), which speaks for the request at whatever epoch it has reached",
    )


StreamEvent = Annotated[TokenChunk | FinalChunk | ErrorChunk, Field(discriminator="kind")]


class MoveMark(Message):
    """Published on a request's stream channel when it moves to another worker, by the step that moves
    it: from here on, chunks of an older epoch are a lost worker's late writes, and are dropped. Never
    logged."""

    kind: Literal["moved"] = "moved"
    request_id: RequestId
    epoch: Epoch = Field(ge=1, description="the epoch the request's new worker writes under")
    seq: int = Field(ge=0, description="the first sequence number of that epoch")


ChannelMessage = Annotated[TokenChunk | FinalChunk | ErrorChunk | MoveMark, Field(discriminator="kind")]


class Heartbeat(Message):
    """A worker's live state, refreshed about once a second under hb:<pool>:<worker> with a TTL."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # figures placement divides

    worker_id: Name
    pool: Name
    model: str
    state: WorkerState
    seq: int = Field(ge=0)
    sent_at: float
    ttl_ms: int = Field(gt=0)
    kv_blocks_total: int = Field(ge=0)
    kv_blocks_free: int = Field(ge=0)
    block_size: int = Field(gt=0)
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    inbox_pending: int = Field(ge=0)
    max_running: int = Field(default=0, ge=0, description="requests it runs at once; 0 if not stated")
    light_slots: int = Field(
        default=0,
        ge=0,
        description="running slots beyond max_running that only an interactive request of a team under "
        "its share of this worker may take",
    )
    decode_tokens_per_s: float = Field(ge=0.0)
    role: KvRole = Field(
        default="both", description="prefill: runs prefill jobs only; decode or both: requests"
    )
    prefill_tokens_per_s: float = Field(
        default=0.0, ge=0.0, description="prompt tokens computed per second of prefill work, recently"
    )
    prefill_backlog: int = Field(
        default=0,
        ge=0,
        description="uncached prompt tokens not computed yet: of the prefill jobs (a prefill worker), of "
        "the requests without a first token (any other)",
    )
    step_s: float = Field(default=0.0, ge=0.0, description="a decode step, recently (0: not measured)")
    ttft_correction: float = Field(
        default=1.0,
        gt=0.0,
        le=1000.0,
        description="observed over predicted time to first token of its recent requests, smoothed",
    )
    ttft_error: float = Field(
        default=0.0, ge=0.0, description="mean relative error of the corrected prediction, recently"
    )
    tensor_parallel_size: int = Field(default=1, gt=0)
    spec_decoding: bool = False
    kv_events: bool = Field(default=False, description="the worker publishes a precise prefix index")
    kv_index_seq: int = Field(default=0, ge=0)
    started_at: float
    load_seconds: float | None = None
    ready_at: float | None = Field(default=None, description="when the worker became ready (epoch seconds)")
    completed_per_s: float = Field(default=0.0, ge=0.0, description="requests finished per second, recently")
    prefix_query_tokens: int = Field(
        default=0, ge=0, description="prompt tokens looked up in the prefix cache"
    )
    prefix_hit_tokens: int = Field(default=0, ge=0, description="of those, tokens found cached")
    preemptions: int = Field(
        default=0, ge=0, description="running requests the engine preempted since it started, in total"
    )
    adapters: tuple[str, ...] = Field(
        default=(), max_length=1024, description="LoRA adapters the engine holds, least recently used first"
    )
    adapter_slots: int = Field(default=0, ge=0, description="LoRA adapters it runs at once (0: none)")
    adapters_in_use: int = Field(
        default=0, ge=0, description="distinct LoRA adapters of the requests running on it"
    )
    error: str | None = Field(default=None, max_length=2000, description="why a failed worker stopped")


class PrefillJob(Message):
    """A disaggregated request, for its prefill worker: run its prompt for one token with the KV saved
    under the handoff id, then push a KvReady to the request's `kv_ready` list."""

    handoff_id: HandoffId
    decode_worker: Name
    request: InferenceRequest
    deadline: float = Field(description="epoch seconds after which the decode worker no longer waits")


class KvReady(Message):
    """A prefill worker's answer to a PrefillJob."""

    handoff_id: HandoffId
    worker_id: Name
    ok: bool
    prefill_s: float = Field(ge=0.0, description="running the job: from its start to the KV saved")
    error: str | None = Field(default=None, max_length=2000)
    remote: dict[str, Any] | None = Field(
        default=None, description="an engine-to-engine connector's transfer parameters, for the decode side"
    )


class CancelNotice(Message):
    """Published on the cancel channel when a client goes away or a request must stop."""

    request_id: RequestId
    reason: str
    sent_at: float


class DeadLetter(Message):
    """A message a consumer could not use, with where it came from and why."""

    source: str = Field(description="topic or stream the message was read from")
    partition: int | None = None
    offset: int | None = None
    reason: str
    payload: str = Field(
        description="the raw bytes, decoded as UTF-8 with replacement, cut to a bounded size"
    )
    consumer: str
    failed_at: float


POOL_STATE_STALE_S = 10.0  # a PoolState older than this no longer describes its pool


class PoolState(Message):
    """A pool as the scaler last saw it, kept under poolstate:<pool> for admission control. The key lives
    at least POOL_STATE_STALE_S, whatever the scaler's tick: the reader judges age by `updated_at`, and a
    key that lapsed between two slow rounds would read as "nothing known" and open the gate."""

    pool: Name
    lag: int = Field(ge=0)
    held: int = Field(default=0, ge=0)
    ready: int = Field(ge=0)
    starting: int = Field(ge=0)
    draining: int = Field(ge=0)
    updated_at: float

    @property
    def backlog(self) -> int:
        return self.lag  # held requests are uncommitted, so `lag` counts them already


class KvEventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class KvEvent(Message):
    """A change to a worker's prefix cache, appended to kv:<worker>; seq has no gaps within one worker."""

    worker_id: Name
    seq: int = Field(ge=1)
    kind: KvEventKind
    block_hashes: tuple[str, ...] = ()


class KvSnapshot(Message):
    """Every block hash a worker held after applying event `seq`, for consumers that fell behind."""

    worker_id: Name
    seq: int = Field(ge=0)
    block_hashes: tuple[str, ...]
    taken_at: float
