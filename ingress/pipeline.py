"""The steps every generating endpoint shares: authenticate (a dependency), read the body through the input
boundary, resolve the pool, admit (pool gate, quota, output plan), queue on Kafka, and relay the answer as
SSE or whole. The chat and completion routes and the Responses API are built from these."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import structlog
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from redis.exceptions import RedisError

from ingress import relay, tracing
from ingress.auth import Caller
from ingress.context import IngressContext
from ingress.metrics import ACTIVE_STREAMS, INTER_TOKEN, REJECTIONS, REQUESTS, TTFT
from ingress.resume import (
    STREAM_HEADER,
    Ping,
    StreamRecord,
    last_event_id,
    new_token,
    numbered,
    request_id_of,
    sse_frame,
    token_matches,
)
from ingress.sse_response import SseResponse
from ingress.streams import RESYNC, HubDisconnected, Subscription
from openai_api import admission
from openai_api.errors import (
    ApiError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ServiceUnavailable,
)
from openai_api.openai_types import ChatCompletionRequest, ChatMessage, GenerationFields, ResponseShape
from openai_api.structured import (
    OutputPlan,
    check_sizes,
    checked_param,
    plan_output,
    tool_definitions,
    xgrammar_check,
)
from openai_api.tokenizer import encode_off_loop
from plumbing.replay import is_terminal, log_ttl_ms
from queue_schemas.boundary import InputRefused, load_untrusted
from queue_schemas.config import PoolConfig
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, StreamEvent, Tier, TokenChunk

log = structlog.get_logger("sluice.ingress")


def get_context(request: Request) -> IngressContext:
    ctx: IngressContext = request.app.state.ctx
    return ctx


Context = Annotated[IngressContext, Depends(get_context)]


async def get_caller(request: Request, ctx: Context) -> Caller:
    return await ctx.auth.authenticate(request.headers.get("authorization"))


Team = Annotated[Caller, Depends(get_caller)]


def inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """Replace `#/$defs/X` references by X itself, so the schema stands alone inside the OpenAPI document."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [inline_refs(v, defs) for v in node]
    return node


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Document the JSON body in the OpenAPI schema; the handler parses it itself for OpenAI-style errors."""
    schema = model.model_json_schema()
    schema = inline_refs(schema, schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def read_json_body(request: Request, limit: int) -> tuple[Any, int]:
    """The parsed JSON body and its size, through the input boundary. A body over `limit` is refused as
    soon as that is known: from its Content-Length, or, for a chunked body, at the chunk that crosses the
    limit, never buffered whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body exceeds the {limit}-byte limit.")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise PayloadTooLarge(f"The request body exceeds the {limit}-byte limit.")
    try:
        return load_untrusted(bytes(raw)), len(raw)
    except InputRefused as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None


def resolve_pool(ctx: IngressContext, team: Caller, model: str) -> PoolConfig:
    pool = ctx.pools.pool_for_model(model)
    adapter = model if pool is not None and model != pool.model else None
    if pool is None or not team.key.allows_model(pool.name, adapter):
        raise NotFound(
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return pool


NO_PLAN = OutputPlan()


async def no_plan() -> OutputPlan:
    return NO_PLAN


async def prepare_chat(
    ctx: IngressContext, team: Caller, body: ChatCompletionRequest, size: int
) -> tuple[PoolConfig, list[int], Callable[[], Awaitable[OutputPlan]]]:
    """The pool, the prompt's tokens (tools included) and the deferred output plan of a chat request."""
    pool = resolve_pool(ctx, team, body.model)
    check_sizes(body)
    tokenizer = ctx.tokenizers[pool.name]
    tools = tool_definitions(body)

    def encode(messages: list[ChatMessage]) -> list[int]:
        return tokenizer.encode_chat(messages, tools)

    prompt_ids = await encode_off_loop(encode, body.messages, size)
    compile_check = xgrammar_check if pool.kind.compiles_schemas else None
    call_id = f"call_{secrets.token_hex(12)}"

    async def plan() -> OutputPlan:
        return await ctx.checks.run(
            lambda: plan_output(body, call_id, compile_check, tool_parser=False), checked_param(body)
        )

    return pool, prompt_ids, plan


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request past the gates, with its quota reserved: queue it, or release its reservation."""

    inference: InferenceRequest
    plan: OutputPlan
    headers: dict[str, str]


async def admit(
    ctx: IngressContext,
    team: Caller,
    pool: PoolConfig,
    body: GenerationFields,
    prompt_ids: list[int],
    make_plan: Callable[[], Awaitable[OutputPlan]] = no_plan,
    keep_log_s: int = 0,
    slo: admission.Slo = admission.NO_SLO,
) -> Admitted:
    """Admit (pool and quota), then check the output plan: the steps every generating endpoint
    shares. The plan's checks are the expensive ones, so they come after the gate."""
    if body.tier() is Tier.PRIORITY and not team.key.allow_priority:
        raise PermissionDenied(
            "This API key may not use service_tier 'priority'; use 'default' or 'flex', or a key that "
            "allows priority.",
            param="service_tier",
            code="service_tier_not_allowed",
        )
    inference = admission.build_request(
        body, pool, team.key.team, prompt_ids,
        request_id=admission.new_request_id(), now=time.time(), timeout_s=ctx.settings.request_timeout_s,
        key_id=team.key.key_id, keep_log_s=keep_log_s, slo=slo,
    )  # fmt: skip
    try:
        await ctx.pool_gate.check(pool)
        hold_s = inference.deadline - inference.created_at + 60
        cost = admission.reserved_tokens(inference)
        headers = await ctx.quota.reserve(team.team, team.limits, inference.request_id, cost, hold_s)
    except ApiError as err:
        REJECTIONS.labels(pool.name, err.code or err.type).inc()
        raise
    try:
        plan = await make_plan()
    except BaseException:
        await ctx.release(inference.team, inference.request_id)
        raise
    if plan.structured is not None:
        sampling = inference.sampling.model_copy(update={"structured": plan.structured})
        inference = inference.model_copy(update={"sampling": sampling})
    return Admitted(inference, plan, headers)


async def serve(
    ctx: IngressContext,
    team: Caller,
    pool: PoolConfig,
    body: GenerationFields,
    prompt_ids: list[int],
    kind: Literal["chat", "text"],
    make_plan: Callable[[], Awaitable[OutputPlan]] = no_plan,
    slo: admission.Slo = admission.NO_SLO,
) -> Response:
    """Admit, queue, then relay: the steps both completion endpoints share."""
    admitted = await admit(ctx, team, pool, body, prompt_ids, make_plan, slo=slo)
    inference, plan, headers = admitted.inference, admitted.plan, admitted.headers
    model = inference.adapter or pool.model
    saving = None
    if body.stream:  # kept while the stream runs, so a client can read it again (ingress.resume)
        record = stream_record(inference, kind, model, body.include_usage(), plan)
        ttl = log_ttl_ms(inference.deadline, time.time(), False, inference.keep_log_s)
        saving = asyncio.create_task(ctx.streams.save(record, ttl))
        headers = {**headers, STREAM_HEADER: record.path()}
    try:
        sub = await queue(ctx, inference)
    except BaseException:
        if saving is not None:  # never queued: nothing will answer it, so it cannot be read again
            saving.cancel()
            with contextlib.suppress(BaseException):
                await saving
        raise
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    shape = ResponseShape(kind, f"{prefix}-{inference.request_id}", int(inference.created_at), model)
    ACTIVE_STREAMS.labels(pool.name).inc()
    if body.stream:
        assert saving is not None
        try:
            await saving
        except RedisError as exc:  # the stream runs; it cannot be read again elsewhere
            log.warning("stream record not saved", request_id=inference.request_id, error=str(exc))
        stream = sse_events(ctx, sub, inference, relay.SseFormatter(shape, body.include_usage(), plan.tool))
        return SseResponse(stream, ping=ctx.settings.keepalive_s, headers=headers, ping_message_factory=Ping)
    async with gathering(ctx, sub, inference):
        result = await relay.collect(sub, inference, ctx.read_tail, shape, plan.tool)
    return JSONResponse(result, headers=headers)


def stream_record(
    inference: InferenceRequest,
    kind: Literal["chat", "text"],
    model: str,
    include_usage: bool,
    plan: OutputPlan,
) -> StreamRecord:
    return StreamRecord(
        request_id=inference.request_id, team=inference.team, pool=inference.pool, kind=kind, model=model,
        created=int(inference.created_at), deadline=inference.deadline, include_usage=include_usage,
        tool=plan.tool, token=new_token(),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def gathering(
    ctx: IngressContext, sub: Subscription, inference: InferenceRequest
) -> AsyncIterator[None]:
    """A whole (non-streamed) answer being gathered: counted by outcome, cancelled if its client leaves
    first, and its subscription closed either way."""
    pool = inference.pool
    try:
        yield
        REQUESTS.labels(pool, "ok").inc()
    except asyncio.CancelledError:
        ctx.cancel_soon(inference.request_id, "client disconnected")
        REQUESTS.labels(pool, "cancelled").inc()
        raise
    except Exception:
        REQUESTS.labels(pool, "error").inc()
        raise
    finally:
        ACTIVE_STREAMS.labels(pool).dec()
        await sub.close()


async def read_again(
    ctx: IngressContext,
    request: Request,
    completion_id: str,
    kind: Literal["chat", "text"],
    after: int | None,
    token: str | None,
) -> Response:
    """A completion's stream read again (ingress.resume): every event after the last one the client saw,
    then the live ones. The caller proves it may read it by its stream token, or by a key of the
    request's team; any other caller gets the 404 of a stream that does not exist."""
    missing = NotFound(f"No stream found for '{completion_id}'.", param="completion_id", code="not_found")
    rid = request_id_of(completion_id, kind)
    if rid is None:
        raise missing
    seen = last_event_id(request.headers.get("last-event-id"), after)
    if seen is None:
        raise InvalidRequest(
            "Last-Event-ID must be the id of an event of this stream.", param="Last-Event-ID"
        )
    try:
        record = await ctx.streams.load(rid)
    except RedisError as exc:
        raise ServiceUnavailable("Streams cannot be read now; retry shortly.") from exc
    if token is not None:
        allowed = record is not None and token_matches(record, token)
    else:
        caller = await ctx.auth.authenticate(request.headers.get("authorization"))
        allowed = record is not None and record.team == caller.team
    if record is None or not allowed or record.kind != kind:
        raise missing
    shape = ResponseShape(kind, record.completion_id, record.created, record.model)
    try:
        logged = await ctx.read_log(rid, 0)
    except RedisError as exc:
        raise ServiceUnavailable("Streams cannot be read now; retry shortly.") from exc
    if logged and is_terminal(logged[-1]) and seen >= events_made(shape, record, logged) - 1:
        return Response(status_code=204)  # it has ended and the client has it all: an EventSource stops
    try:
        await ctx.streams.attach(rid)
    except RedisError as exc:
        raise ServiceUnavailable("Streams cannot be read now; retry shortly.") from exc
    try:
        sub = await ctx.hub.subscribe(ctx.settings.names.stream_channel(rid))
    except HubDisconnected as exc:
        ctx.leave(rid, record.pool)  # counted in, never read: counted out as a reader that left
        raise ServiceUnavailable("Streams cannot be read now; retry shortly.") from exc
    sub.deliver(RESYNC)  # what the log holds first, then the live stream
    ACTIVE_STREAMS.labels(record.pool).inc()
    fmt = relay.SseFormatter(shape, record.include_usage, record.tool)
    stream = sse_events(ctx, sub, record, fmt, after=seen)
    return SseResponse(
        stream,
        ping=ctx.settings.keepalive_s,
        headers={STREAM_HEADER: record.path()},
        ping_message_factory=Ping,
    )


def events_made(shape: ResponseShape, record: StreamRecord, chunks: list[StreamEvent]) -> int:
    """How many numbered events a stream of these chunks has. Pure."""
    fmt = relay.SseFormatter(shape, record.include_usage, record.tool)
    return len(fmt.opening()) + sum(len(fmt.format(chunk)) for chunk in chunks)


async def queue(ctx: IngressContext, inference: InferenceRequest) -> Subscription:
    """Subscribe to the reply channel, then produce; release the reservation if either fails."""
    try:
        sub = await ctx.hub.subscribe(ctx.settings.names.stream_channel(inference.request_id))
    except HubDisconnected as exc:
        log.warning("stream not subscribed", request_id=inference.request_id, error=str(exc))
        await ctx.release(inference.team, inference.request_id)
        raise ServiceUnavailable("The stream relay is unavailable; retry shortly.") from exc
    try:
        await ctx.publish(inference)
    except BaseException:
        await sub.close()
        await ctx.release(inference.team, inference.request_id)
        raise
    return sub


async def sse_events(
    ctx: IngressContext,
    sub: Subscription,
    inference: InferenceRequest | StreamRecord,
    fmt: relay.SseFormatter,
    *,
    after: int = -1,
) -> AsyncIterator[bytes]:
    """SSE events for one request, each with its number as its id, those after `after` only (a client
    reading it again). If the client goes away first, the request is cancelled after its pool's grace
    period unless a reader comes back (ingress.resume). An error this ingress made itself has no id: a
    client that reconnects reads the log, where it is not. Frames are made as bytes, and those of chunks
    that arrive together go out in one write."""
    finished = False
    outcome = "cancelled"
    traced = tracing.Relay(inference.request_id, inference.pool)
    final: FinalChunk | None = None
    sent = 0  # events made so far, sent or skipped
    ready: list[bytes] = []  # frames made since the last FLUSH: written together, in one send
    inter_token = INTER_TOKEN.labels(inference.pool)
    try:
        opening = fmt.opening()
        if frames := numbered(opening, sent, after):
            yield frames
        sent += len(opening)
        last = 0.0
        async for event in relay.marked_events(sub, inference, ctx.read_tail):
            if isinstance(event, relay.Flush):  # nothing more at hand: what was made goes out now
                if frames := b"".join(ready):
                    yield frames
                ready.clear()
                continue
            traced.chunk()
            now = time.time()
            if isinstance(inference, InferenceRequest):  # its first reading, not a stream read again
                if event.seq == 0:
                    TTFT.labels(inference.pool).observe(now - inference.created_at)
                elif isinstance(event, TokenChunk | FinalChunk) and event.num_tokens:
                    inter_token.observe((now - last) / event.num_tokens)
            last = now
            payloads = fmt.format(event)
            if isinstance(event, relay.LocalError):
                outcome = "error"
                ready.extend(sse_frame(payload) for payload in payloads)
                continue  # the stream ends here; the request may still run, for a reader to come back
            ready.append(numbered(payloads, sent, after))
            sent += len(payloads)
            if isinstance(event, FinalChunk | ErrorChunk):
                finished = True
                outcome = "ok" if isinstance(event, FinalChunk) else "error"
                final = event if isinstance(event, FinalChunk) else None
        if frames := b"".join(ready):
            yield frames
    finally:
        traced.done(outcome, final)
        if not finished:
            ctx.leave(inference.request_id, inference.pool)
        else:
            ctx.stream_ended(inference.request_id)
        if isinstance(inference, InferenceRequest):  # a request counted once, by its first reading
            REQUESTS.labels(inference.pool, outcome).inc()
        ACTIVE_STREAMS.labels(inference.pool).dec()
        await sub.close()
