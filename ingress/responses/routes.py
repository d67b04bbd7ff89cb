"""The Responses API: create (streamed or not, in the foreground or the background), retrieve, resume a
stream, cancel and delete. A request is served as the chat request it maps onto (pipeline.admit, the same
queue and engines); its events are made from its request's chunks (ingress.responses.events).

A foreground stream whose client goes away is cancelled, as a chat stream is. A background response
runs whether or not anyone reads it; its stream can be read again, from the start or after the last
event a client saw (`starting_after`), through any ingress, until the record expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse

from ingress import relay
from ingress.context import IngressContext
from ingress.metrics import ACTIVE_STREAMS, REQUESTS
from ingress.pipeline import (
    Context,
    Team,
    admit,
    body_schema,
    gathering,
    prepare_chat,
    queue,
    read_json_body,
)
from ingress.responses.api import (
    ResponsesRequest,
    as_chat,
    check_served,
    output_as_input,
    page_of,
    parse_items,
    parse_response_id,
    repeated_id,
    request_items,
    stored_items,
)
from ingress.responses.events import (
    ResponseEvents,
    ResponseRecord,
    replayed,
    shown_status,
    unseen,
)
from ingress.streams import RESYNC, HubDisconnected, Subscription
from ingress.team_caps import TeamStorage
from ingress.tracing import Relay
from openai_api.admission import parse_body
from openai_api.errors import InvalidRequest, NotFound, ServiceUnavailable, from_bus_error
from openai_api.structured import OutputPlan
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, StreamEvent

router = APIRouter()


def echo_fields(body: ResponsesRequest) -> dict[str, Any]:
    """What the response object repeats of its request."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
    choice = body.tool_choice
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "service_tier": body.service_tier or "default",
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "user": body.user,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "text": {"format": {"type": "text"}, **text},
        "store": body.store,
        "previous_response_id": body.previous_response_id,
    }


def record_of(
    body: ResponsesRequest, inference: InferenceRequest, model: str, plan: OutputPlan
) -> ResponseRecord:
    return ResponseRecord(
        request_id=inference.request_id,
        team=inference.team,
        model=model,
        created_at=inference.created_at,
        deadline=inference.deadline,
        prompt_tokens=inference.client_prompt_tokens,
        background=body.background,
        tool=plan.tool,
        echo=echo_fields(body),
    )


@router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
async def create_response(request: Request, ctx: Context, team: Team) -> Response:
    raw, size = await read_json_body(request, ctx.settings.max_body_bytes)
    check_served(raw)
    body = parse_body(ResponsesRequest, raw)
    if body.background and not body.store:
        raise InvalidRequest("A background response must be stored: store cannot be false.", param="store")
    history = [] if body.previous_response_id is None else await before(ctx, team, body.previous_response_id)
    items = history + stored_items(request_items(body))
    duplicate = repeated_id(items)
    if duplicate is not None:
        raise InvalidRequest(f"Duplicate item found with id '{duplicate}'.", param="input")
    try:
        chat = as_chat(body.model_copy(update={"input": parse_items(items)}))
    except ValidationError as exc:  # an earlier turn's item that is no input item now
        raise InvalidRequest(f"The conversation cannot be continued: {exc.errors()[0]['msg']}.",
                             param="previous_response_id") from None  # fmt: skip
    # The conversation's size, not the body's, says whether it is tokenized off the event loop.
    size += len(orjson.dumps(history)) if history else 0
    pool, prompt_ids, plan = await prepare_chat(ctx, team, chat, size)
    keep_s = ctx.settings.responses_retain_s if body.store else 0
    admitted = await admit(ctx, team, pool, chat, prompt_ids, plan, keep_s)
    inference, headers = admitted.inference, admitted.headers
    record = record_of(body, inference, inference.adapter or pool.model, admitted.plan)
    if body.store:
        storage = TeamStorage(ctx.redis, ctx.settings.names, ctx.settings.team_caps())
        try:
            await storage.hold_response(team.team, inference.request_id, record.deadline + keep_s)
            await ctx.responses.save(record, items)
        except BaseException as exc:
            await ctx.release(inference.team, inference.request_id)
            if isinstance(exc, RedisError):
                raise ServiceUnavailable("Responses cannot be stored now; retry shortly.") from exc
            raise
    events = ResponseEvents(record)
    try:
        if body.background and not body.stream:
            try:
                await ctx.publish(inference)
            except BaseException:
                await ctx.release(inference.team, inference.request_id)
                raise
            events.opening()
            return JSONResponse(events.body(), headers=headers)
        sub = await queue(ctx, inference)
    except BaseException:
        if body.store:  # never queued: nothing will answer it
            with contextlib.suppress(RedisError):
                await ctx.responses.delete(inference.request_id)
        raise
    ACTIVE_STREAMS.labels(pool.name).inc()
    if body.stream:
        stream = sse(ctx, sub, events, after=-1, pool=pool.name, cancel_on_leave=not body.background)
        return EventSourceResponse(stream, ping=ctx.settings.keepalive_s, headers=headers)
    traced = Relay(record.request_id, pool.name)
    last: StreamEvent | None = None
    async with gathering(ctx, sub, inference):
        events.opening()
        try:
            async for last in relay.events(sub, record, ctx.read_tail):
                traced.chunk()
                if isinstance(last, ErrorChunk):
                    raise from_bus_error(last.code, last.message)
                events.feed(last)
        finally:
            traced.done(outcome_of(last), last)
    return JSONResponse(events.body(), headers=headers)


async def sse(
    ctx: IngressContext,
    sub: Subscription,
    events: ResponseEvents,
    *,
    after: int,
    pool: str,
    cancel_on_leave: bool,
) -> AsyncIterator[dict[str, str]]:
    """A response's events after sequence number `after`. A foreground response whose client leaves
    first is cancelled; a background one runs on, and its stream can be read again. Only a foreground
    stream's outcome is counted: a background response does not end with its stream."""
    record = events.record
    outcome = "cancelled"
    traced = Relay(record.request_id, pool)
    chunk: StreamEvent | None = None
    try:
        for event in unseen(events.opening(), after):
            yield _sse(event)
        async for chunk in relay.events(sub, record, ctx.read_tail, quiet_disconnect=not cancel_on_leave):
            traced.chunk()
            for event in unseen(events.feed(chunk), after):
                yield _sse(event)
            if isinstance(chunk, ErrorChunk):
                outcome = "error"
            elif events.status not in ("queued", "in_progress"):
                outcome = "ok"
    finally:
        traced.done(outcome, chunk)
        if cancel_on_leave:
            if outcome == "cancelled":
                ctx.cancel_soon(record.request_id, "client disconnected")
            REQUESTS.labels(pool, outcome).inc()
        ACTIVE_STREAMS.labels(pool).dec()
        await sub.close()


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": orjson.dumps(event).decode()}


async def find(ctx: IngressContext, team: Team, response_id: str) -> tuple[ResponseRecord, bool]:
    """The caller's stored response and whether a cancel of it was accepted; another team's is a 404,
    the same as one that never existed."""
    missing = NotFound(f"No response found with id '{response_id}'.", param="response_id", code="not_found")
    rid = parse_response_id(response_id)
    if rid is None:
        raise missing
    try:
        found = await ctx.responses.load(rid)
    except RedisError as exc:
        raise ServiceUnavailable("Responses cannot be read now; retry shortly.") from exc
    if found is None or found[0].team != team.team:
        raise missing
    return found


async def before(ctx: IngressContext, team: Team, response_id: str) -> list[dict[str, Any]]:
    """The conversation a response continues: the previous response's input items and its output. The
    caller's team's stored responses only (another's is a 404); one still running is a 400."""
    param = "previous_response_id"
    try:
        found = await find(ctx, team, response_id)
    except NotFound:
        raise NotFound(
            f"No response found with id '{response_id}'.", param=param, code="previous_response_not_found"
        ) from None
    record, cancelled = found
    events = await current(ctx, record)
    status = shown_status(events, cancelled, time.time()) or events.status
    if status in ("queued", "in_progress"):
        raise InvalidRequest(
            f"Response '{response_id}' is still {status}; continue from it once it has ended.", param=param
        )
    try:
        items = await ctx.responses.input_items(record.request_id)
    except RedisError as exc:
        raise ServiceUnavailable("Responses cannot be read now; retry shortly.") from exc
    if items is None:
        raise InvalidRequest(f"Response '{response_id}' was stored without its input.", param=param)
    return items + output_as_input(events.output)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    ctx: Context,
    team: Team,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=128)] = None,
    include: Annotated[list[str] | None, Query()] = None,
) -> JSONResponse:
    """The input items a response was made from (with every earlier turn's, for a chained one), a page
    at a time, as OpenAI lists them: newest first unless `order=asc`, the next page `after` the last id."""
    if include:
        raise InvalidRequest("'include' is not supported by this server.", param="include")
    record, _ = await find(ctx, team, response_id)
    try:
        items = await ctx.responses.input_items(record.request_id)
    except RedisError as exc:
        raise ServiceUnavailable("Responses cannot be read now; retry shortly.") from exc
    page = page_of(items or [], limit, order, after)
    if page is None:
        raise InvalidRequest(f"No input item with id '{after}' in this response.", param="after")
    return JSONResponse(page)


async def current(ctx: IngressContext, record: ResponseRecord) -> ResponseEvents:
    """The response as its log shows it now."""
    try:
        chunks = await ctx.read_log(record.request_id, 0)
    except RedisError as exc:
        raise ServiceUnavailable("Responses cannot be read now; retry shortly.") from exc
    return replayed(record, chunks)


async def ended_soon(ctx: IngressContext, record: ResponseRecord, within_s: float) -> ResponseEvents:
    """The response once its log shows its end (a worker reports what a cancelled request used when
    it stops), or as it is after `within_s`."""
    give_up = time.monotonic() + within_s
    while True:
        events = await current(ctx, record)
        if events.status not in ("queued", "in_progress") or time.monotonic() >= give_up:
            return events
        await asyncio.sleep(0.05)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: str,
    ctx: Context,
    team: Team,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
    include: Annotated[list[str] | None, Query()] = None,
    include_obfuscation: bool | None = None,
) -> Response:
    """The response now, or (`stream=true`) its events, from the start or after `starting_after`."""
    if include:
        raise InvalidRequest("'include' is not supported by this server.", param="include")
    if starting_after is not None and not stream:
        raise InvalidRequest("starting_after is only allowed with stream=true.", param="starting_after")
    record, cancelled = await find(ctx, team, response_id)
    if not stream:
        events = await current(ctx, record)
        return JSONResponse(events.body(shown_status(events, cancelled, time.time())))
    try:
        sub = await ctx.hub.subscribe(ctx.settings.names.stream_channel(record.request_id))
    except HubDisconnected as exc:
        raise ServiceUnavailable("The stream relay is unavailable; retry shortly.") from exc
    sub.deliver(RESYNC)  # read what the log holds first, then follow the live stream
    pool = _pool_of(ctx, record)
    ACTIVE_STREAMS.labels(pool).inc()
    after = -1 if starting_after is None else starting_after
    events = ResponseEvents(record)
    return EventSourceResponse(
        sse(ctx, sub, events, after=after, pool=pool, cancel_on_leave=False), ping=ctx.settings.keepalive_s
    )


def _pool_of(ctx: IngressContext, record: ResponseRecord) -> str:
    pool = ctx.pools.pool_for_model(record.model)
    return pool.name if pool is not None else "unknown"


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, ctx: Context, team: Team) -> JSONResponse:
    """Stop a background response: the engine stops and the team is charged what was generated. A
    response that has ended already is returned as it is."""
    record, cancelled = await find(ctx, team, response_id)
    if not record.background:
        raise InvalidRequest("Only background responses can be cancelled.", param="response_id")
    events = await current(ctx, record)
    if events.status in ("queued", "in_progress"):
        try:
            await ctx.responses.cancel(record)
        except RedisError as exc:
            raise ServiceUnavailable("The response cannot be cancelled now; retry shortly.") from exc
        ctx.cancel_soon(record.request_id, "response cancelled")
        events = await ended_soon(ctx, record, ctx.settings.responses_cancel_wait_s)
        cancelled = True
    return JSONResponse(events.body(shown_status(events, cancelled, time.time())))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: Context, team: Team) -> JSONResponse:
    """Forget a stored response (one still running is cancelled first)."""
    record, cancelled = await find(ctx, team, response_id)
    events = await current(ctx, record)
    try:
        if events.status in ("queued", "in_progress") and not cancelled:
            await ctx.responses.cancel(record)
            ctx.cancel_soon(record.request_id, "response deleted")
        await ctx.responses.delete(record.request_id)
        await TeamStorage(ctx.redis, ctx.settings.names, ctx.settings.team_caps()).drop_response(
            team.team, record.request_id
        )
    except RedisError as exc:
        raise ServiceUnavailable("The response cannot be deleted now; retry shortly.") from exc
    return JSONResponse({"id": record.response_id, "object": "response.deleted", "deleted": True})


def outcome_of(last: StreamEvent | None) -> str:
    """How a gathered answer ended, by its last chunk: ok, error, or cancelled (none ended it). Pure."""
    if isinstance(last, FinalChunk):
        return "ok"
    return "error" if isinstance(last, ErrorChunk) else "cancelled"
