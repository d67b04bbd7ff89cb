"""HTTP routes: the OpenAI completion surface, models, health and metrics; each is built from the shared
pipeline (ingress.pipeline)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import structlog
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ingress.pipeline import (
    Context,
    Team,
    body_schema,
    prepare_chat,
    read_again,
    read_json_body,
    resolve_pool,
    serve,
)
from openai_api.admission import parse_body, slo_from_headers
from openai_api.errors import InvalidRequest
from openai_api.openai_types import ChatCompletionRequest, CompletionRequest
from openai_api.tokenizer import encode_off_loop
from plumbing.health import health_body

log = structlog.get_logger("sluice.ingress")
router = APIRouter()


@router.get("/healthz")
async def healthz(ctx: Context) -> JSONResponse:
    """200 while the stream hub is connected and every background loop is alive, else 503."""
    code, body = health_body(ctx.liveness, extra=[("redis_streams", ctx.hub.connected)])
    return JSONResponse(body, status_code=code)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(ctx: Context, team: Team) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for pool in ctx.pools.pools:
        if not team.key.allows_pool(pool.name):
            continue
        data.append({"id": pool.model, "object": "model", "created": 0, "owned_by": "sluice"})
        data.extend(
            {"id": a.name, "object": "model", "created": 0, "owned_by": pool.name, "parent": pool.model}
            for a in pool.adapters
            if team.key.allows_model(pool.name, a.name)
        )
    return {"object": "list", "data": data}


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request, ctx: Context, team: Team) -> Response:
    """Checks in cost order: the key (a dependency), the body and its sizes, the prompt's tokens, the
    pool and quota gate, and only then the schemas (validated and compiled in a check thread). The
    headers x-slo-ttft-ms and x-slo-tpot-ms set the request's own latency objectives."""
    slo = slo_from_headers(request.headers)
    raw, size = await read_json_body(request, ctx.settings.max_body_bytes)
    body = parse_body(ChatCompletionRequest, raw)
    pool, prompt_ids, plan = await prepare_chat(ctx, team, body, size)
    return await serve(ctx, team, pool, body, prompt_ids, "chat", plan, slo)


def stream_route(kind: Literal["chat", "text"]) -> Callable[..., Awaitable[Response]]:
    """GET .../{id}/stream: a streamed completion read again, through any ingress: the events after
    `Last-Event-ID` (or `after`), then the live ones (ingress.resume)."""

    async def read(
        completion_id: str,
        request: Request,
        ctx: Context,
        after: Annotated[int | None, Query(ge=-1, lt=10**9)] = None,
        token: Annotated[str | None, Query(max_length=64)] = None,
    ) -> Response:
        return await read_again(ctx, request, completion_id, kind, after, token)

    read.__doc__ = stream_route.__doc__
    return read


router.add_api_route("/v1/chat/completions/{completion_id}/stream", stream_route("chat"), methods=["GET"])
router.add_api_route("/v1/completions/{completion_id}/stream", stream_route("text"), methods=["GET"])


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request, ctx: Context, team: Team) -> Response:
    slo = slo_from_headers(request.headers)
    raw, size = await read_json_body(request, ctx.settings.max_body_bytes)
    body = parse_body(CompletionRequest, raw)
    pool = resolve_pool(ctx, team, body.model)
    encode = ctx.tokenizers[pool.name].encode_text
    prompt_ids = await encode_off_loop(encode, body.prompt_text(), size)
    if not prompt_ids:
        raise InvalidRequest("The prompt is empty.", param="prompt")
    return await serve(ctx, team, pool, body, prompt_ids, "text", slo=slo)
