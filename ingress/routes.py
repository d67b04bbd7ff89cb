"""HTTP routes: the OpenAI surface plus health and metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from ingress import admission, relay
from ingress.auth import authenticate
from ingress.context import IngressContext
from ingress.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable
from ingress.metrics import ACTIVE_STREAMS, REQUESTS, TTFT
from ingress.openai_types import ChatCompletionRequest
from ingress.streams import HubDisconnected, Subscription
from queue_schemas.keys import TeamKey
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest

log = structlog.get_logger("sluice.ingress")
router = APIRouter()


def get_context(request: Request) -> IngressContext:
    ctx: IngressContext = request.app.state.ctx
    return ctx


Context = Annotated[IngressContext, Depends(get_context)]


async def get_team(request: Request, ctx: Context) -> TeamKey:
    return await authenticate(ctx.redis, ctx.settings.names, request.headers.get("authorization"))


Team = Annotated[TeamKey, Depends(get_team)]


@router.get("/healthz")
async def healthz(ctx: Context) -> JSONResponse:
    healthy = ctx.hub.connected
    return JSONResponse({"status": "ok" if healthy else "degraded"}, status_code=200 if healthy else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(ctx: Context, team: Team) -> dict[str, Any]:
    data = [
        {"id": pool.model, "object": "model", "created": 0, "owned_by": "sluice"}
        for pool in ctx.pools.pools
        if team.allows_pool(pool.name)
    ]
    return {"object": "list", "data": data}


async def read_json_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body exceeds the {limit}-byte limit.")
    raw = await request.body()
    if len(raw) > limit:
        raise PayloadTooLarge(f"The request body exceeds the {limit}-byte limit.")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}") from None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param) from None
        if param == "n":
            raise InvalidRequest("Only n=1 is supported.", param="n") from None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, ctx: Context, team: Team) -> Response:
    chat = parse_chat_request(await read_json_body(request, ctx.settings.max_body_bytes))
    pool = ctx.pools.pool_for_model(chat.model)
    if pool is None or not team.allows_pool(pool.name):
        raise NotFound(
            f"The model '{chat.model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    prompt_ids = ctx.tokenizers[pool.name].encode_chat(chat.messages)
    inference = admission.build_request(
        chat,
        pool,
        team,
        prompt_ids,
        request_id=admission.new_request_id(),
        now=time.time(),
        timeout_s=ctx.settings.request_timeout_s,
    )
    try:
        sub = await ctx.hub.subscribe(ctx.settings.names.stream_channel(inference.request_id))
    except HubDisconnected as exc:
        raise ServiceUnavailable("The stream relay is unavailable; retry shortly.") from exc
    try:
        await ctx.publish(inference)
    except BaseException:
        await sub.close()
        raise
    completion_id = f"chatcmpl-{inference.request_id}"
    ACTIVE_STREAMS.labels(pool.name).inc()
    if chat.stream:
        formatter = relay.SseFormatter(
            completion_id, int(inference.created_at), pool.model, chat.include_usage()
        )
        stream = sse_events(ctx, sub, inference, formatter)
        return EventSourceResponse(stream, ping=ctx.settings.keepalive_s)
    try:
        body = await relay.collect(sub, inference, completion_id)
        REQUESTS.labels(pool.name, "ok").inc()
        return JSONResponse(body)
    except asyncio.CancelledError:
        ctx.cancel_soon(inference.request_id, "client disconnected")
        raise
    except Exception:
        REQUESTS.labels(pool.name, "error").inc()
        raise
    finally:
        ACTIVE_STREAMS.labels(pool.name).dec()
        await sub.close()


async def sse_events(
    ctx: IngressContext, sub: Subscription, inference: InferenceRequest, fmt: relay.SseFormatter
) -> AsyncIterator[dict[str, str]]:
    """SSE payloads for one request; if the client goes away first, cancel the request upstream."""
    finished = False
    outcome = "cancelled"
    try:
        yield {"data": fmt.first()}
        async for event in relay.events(sub, inference):
            if event.seq == 0:
                TTFT.labels(inference.pool).observe(time.time() - inference.created_at)
            for payload in fmt.format(event):
                yield {"data": payload}
            if isinstance(event, FinalChunk | ErrorChunk):
                finished = True
                outcome = "ok" if isinstance(event, FinalChunk) else "error"
    finally:
        if not finished:
            ctx.cancel_soon(inference.request_id, "client disconnected")
        REQUESTS.labels(inference.pool, outcome).inc()
        ACTIVE_STREAMS.labels(inference.pool).dec()
        await sub.close()
