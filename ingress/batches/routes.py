"""HTTP routes of OpenAI's Files and Batch APIs: `/v1/files` and `/v1/batches`.

A team reaches only its own files and batches: every record is stored under the team that created it
and looked up under the caller's team, so another team's id is a 404 like an unknown one. The work of a
batch is done by the ingresses' batch keepers (ingress.batches.keeper); these handlers only record.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.datastructures import UploadFile

from ingress.auth import Caller, bearer_token
from ingress.batches.api import (
    CANCELLABLE,
    COMPLETION_WINDOWS,
    BatchCreate,
    FileRecord,
    FileSummary,
    Status,
    as_text,
    batch_object,
    create_problem,
    decode_fields,
    expires_at,
    expiry_problem,
    list_object,
    new_batch_fields,
    new_batch_id,
    new_file_id,
    object_key,
    page,
    scan_file,
)
from ingress.batches.keeper import remove_file, save_file_record, transition
from ingress.context import IngressContext
from ingress.pipeline import Context, Team, body_schema, read_json_body
from ingress.team_caps import BATCH_LINES, BATCHES, BYTES, FILES, RESULT_ROOM, TeamStorage
from openai_api.errors import (
    InsufficientQuota,
    InvalidRequest,
    LengthRequired,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
)
from openai_api.quota_gate import day_budget_left
from plumbing.clients import mget_any
from queue_schemas.keys import hash_api_key

router = APIRouter()

MULTIPART_SLACK = 64 * 1024  # form boundaries and the purpose field around the file
DOWNLOAD_PIECE = 1024 * 1024


def _not_found(kind: str, object_id: str) -> NotFound:
    return NotFound(f"No such {kind}: '{object_id}'.", param="id", code="not_found")


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be an integer from 1 to {most}.", param="limit")
    return int(raw)


async def _ids(ctx: Context, index: str, descending: bool) -> list[str]:
    """The ids in one of the team's indexes, newest first when `descending`."""
    try:
        raw: list[bytes] = await ctx.redis.zrange(index, 0, -1, desc=descending)  # type: ignore[assignment]
    except RedisError as exc:
        raise ServiceUnavailable("The file index is unreachable; retry shortly.") from exc
    return [as_text(i) for i in raw]


async def _file(ctx: Context, team: str, file_id: str) -> FileRecord:
    try:
        raw = await ctx.redis.get(ctx.settings.names.file_record(team, file_id))
    except RedisError as exc:
        raise ServiceUnavailable("The file index is unreachable; retry shortly.") from exc
    record = None if raw is None else FileRecord.model_validate_json(raw)
    if record is None or record.expired(time.time()):  # an expired file waits for the sweep: gone
        raise _not_found("file", file_id)
    return record


UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


def query_schema(*params: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """Query parameters documented for the OpenAPI schema; the handlers read and check them themselves."""
    return {
        "parameters": [{"name": name, "in": "query", "required": False, "schema": s} for name, s in params]
    }


AFTER = ("after", {"type": "string"})


def _storage(ctx: IngressContext) -> TeamStorage:
    return TeamStorage(ctx.redis, ctx.settings.names, ctx.settings.team_caps())


@router.post("/v1/files", openapi_extra=UPLOAD_SCHEMA)
async def upload_file(request: Request, ctx: Context, team: Team) -> JSONResponse:
    """The upload is spooled to disk by the form parser, checked line by line in a thread, then copied
    to the file store in pieces: neither the event loop nor memory ever holds it whole."""
    limit = ctx.settings.files_max_bytes
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        raise LengthRequired("Uploads must declare their Content-Length.")
    if int(declared) > limit + MULTIPART_SLACK:
        raise PayloadTooLarge(f"The file exceeds the {limit}-byte limit.")
    with ctx.uploads.slot(team.team):
        return await _upload(request, ctx, team, limit)


async def _upload(request: Request, ctx: IngressContext, team: Caller, limit: int) -> JSONResponse:
    try:
        form = await request.form(max_files=1, max_fields=4)
    except Exception as exc:  # starlette raises its own parse errors for malformed forms
        raise InvalidRequest(f"The upload is not a valid multipart form: {exc}") from None
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise InvalidRequest(
            "purpose must be 'batch': this server keeps files for batches only.", param="purpose"
        )
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("The form must carry the file in the field 'file'.", param="file")
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    problem = expiry_problem(anchor, seconds)
    if problem is not None:
        raise InvalidRequest(problem, param="expires_after")
    size = upload.size or 0
    if size > limit:
        raise PayloadTooLarge(f"The file exceeds the {limit}-byte limit.")
    stream = upload.file
    summary = await ctx.uploads.run(lambda: _scan(stream))
    if isinstance(summary, str):
        raise InvalidRequest(
            f"The file is not a valid batch input file. {summary}", param="file", code="invalid_file"
        )
    names = ctx.settings.names
    file_id = new_file_id()
    now = int(time.time())
    filename = (upload.filename or "input.jsonl")[:256].encode(errors="replace").decode()
    record = FileRecord(
        id=file_id, team=team.team, purpose="batch", filename=filename, bytes=size, created_at=now,
        key=object_key(team.team, file_id), lines=summary.requests, endpoints=summary.endpoints,
        expires_at=expires_at(now, seconds, ctx.settings.file_expiry_s),
    )  # fmt: skip
    storage = _storage(ctx)
    await storage.take(team.team, {FILES: 1, BYTES: size})
    try:
        await upload.seek(0)
        await ctx.files.put_file(record.key, upload.file)
        await save_file_record(ctx.redis, names, record)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await storage.give(team.team, {FILES: 1, BYTES: size})
            await ctx.files.delete(record.key)
        if isinstance(exc, RedisError):
            raise ServiceUnavailable("The file index is unreachable; retry shortly.") from exc
        raise
    return JSONResponse(record.public())


def _scan(stream: BinaryIO) -> FileSummary | str:
    stream.seek(0)
    return scan_file(stream)


@router.get(
    "/v1/files",
    openapi_extra=query_schema(
        AFTER,
        ("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}),
        ("order", {"type": "string", "enum": ["asc", "desc"]}),
        ("purpose", {"type": "string"}),
    ),
)
async def list_files(request: Request, ctx: Context, team: Team) -> dict[str, Any]:
    limit = _limit(request, 10_000, 10_000)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'.", param="order")
    purpose = request.query_params.get("purpose")
    names = ctx.settings.names
    file_ids = await _ids(ctx, names.files(team.team), descending=order == "desc")
    records = []
    for raw in await mget_any(ctx.redis, [names.file_record(team.team, i) for i in file_ids]):
        if raw is not None:
            record = FileRecord.model_validate_json(raw)
            if (purpose is None or record.purpose == purpose) and not record.expired(time.time()):
                records.append(record)
    ids, has_more = page([r.id for r in records], request.query_params.get("after"), limit)
    by_id = {r.id: r for r in records}
    return list_object([by_id[i].public() for i in ids], has_more)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, ctx: Context, team: Team) -> dict[str, Any]:
    return (await _file(ctx, team.team, file_id)).public()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, ctx: Context, team: Team) -> Response:
    """The file's bytes, sent a piece at a time (a file may be hundreds of megabytes)."""
    record = await _file(ctx, team.team, file_id)
    try:
        first = await ctx.files.read_range(record.key, 0, DOWNLOAD_PIECE)
    except FileNotFoundError:
        raise _not_found("file", file_id) from None

    async def pieces() -> AsyncIterator[bytes]:
        yield first
        offset = len(first)
        while offset < record.bytes:
            piece = await ctx.files.read_range(record.key, offset, DOWNLOAD_PIECE)
            if not piece:
                return
            yield piece
            offset += len(piece)

    return StreamingResponse(
        pieces(), media_type="application/octet-stream", headers={"content-length": str(record.bytes)}
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, ctx: Context, team: Team) -> dict[str, Any]:
    await _file(ctx, team.team, file_id)
    try:
        await remove_file(ctx.redis, ctx.settings.names, ctx.files, _storage(ctx), team.team, file_id)
    except RedisError as exc:
        raise ServiceUnavailable("The file index is unreachable; retry shortly.") from exc
    return {"id": file_id, "object": "file", "deleted": True}


async def _batch(ctx: Context, team: str, batch_id: str) -> dict[str, str]:
    try:
        fields = decode_fields(await ctx.redis.hgetall(ctx.settings.names.batch_record(team, batch_id)))
    except RedisError as exc:
        raise ServiceUnavailable("The batch index is unreachable; retry shortly.") from exc
    if not fields:
        raise _not_found("batch", batch_id)
    return fields


@router.post("/v1/batches", openapi_extra=body_schema(BatchCreate))
async def create_batch(request: Request, ctx: Context, team: Team) -> dict[str, Any]:
    raw, _ = await read_json_body(request, ctx.settings.max_body_bytes)
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        body = BatchCreate.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for {param}: {err['msg']}.", param=param) from None
    problem = create_problem(body)
    if problem is not None:
        raise InvalidRequest(problem[0], param=problem[1])
    source = await _file(ctx, team.team, body.input_file_id)
    if source.purpose != "batch":
        raise InvalidRequest(f"The file {source.id} was not uploaded for batch.", param="input_file_id")
    names = ctx.settings.names
    try:
        left = await day_budget_left(ctx.redis, names, team.team, team.limits)
    except RedisError as exc:
        raise ServiceUnavailable("The quota store is unreachable; retry shortly.") from exc
    if left is not None and left <= 0:
        raise InsufficientQuota("The team's daily token budget is spent; the batch would not run.")
    batch_id = new_batch_id()
    now = time.time()
    key_hash = hash_api_key(bearer_token(request.headers.get("authorization")))
    fields = new_batch_fields(batch_id, team.key, body, source.lines, now, key_hash)
    fields["capped"] = "1"  # its share of the caps is given back once, when it is retired
    storage = _storage(ctx)
    await storage.check(team.team, RESULT_ROOM, why=" A batch needs room for its result files.")
    await storage.take(team.team, {BATCHES: 1, BATCH_LINES: source.lines})
    record, listed, active = (
        names.batch_record(team.team, batch_id),
        names.batches(team.team),
        names.active_batches(),
    )
    try:  # the record first and the active set last: the keeper only ever finds whole batches
        await ctx.redis.hset(record, mapping=fields)  # type: ignore[arg-type]
        await ctx.redis.zadd(listed, {batch_id: now})
        await ctx.redis.sadd(active, f"{team.team}/{batch_id}")
    except RedisError as exc:
        with contextlib.suppress(RedisError):  # nothing of a batch that was never answered is left
            await ctx.redis.srem(active, f"{team.team}/{batch_id}")
            await ctx.redis.zrem(listed, batch_id)
            await ctx.redis.delete(record)
            await storage.give(team.team, {BATCHES: 1, BATCH_LINES: source.lines})
        raise ServiceUnavailable("The batch index is unreachable; retry shortly.") from exc
    return batch_object(fields)


@router.get(
    "/v1/batches",
    openapi_extra=query_schema(AFTER, ("limit", {"type": "integer", "minimum": 1, "maximum": 100})),
)
async def list_batches(request: Request, ctx: Context, team: Team) -> dict[str, Any]:
    limit = _limit(request, 20, 100)
    names = ctx.settings.names
    horizon = time.time() - ctx.settings.batch_retain_s - max(COMPLETION_WINDOWS.values())
    with contextlib.suppress(RedisError):  # records older than any kept one are gone: so are their ids
        await ctx.redis.zremrangebyscore(names.batches(team.team), "-inf", horizon)
    ids = await _ids(ctx, names.batches(team.team), descending=True)
    chosen, has_more = page(ids, request.query_params.get("after"), limit)
    data = []
    for batch_id in chosen:
        fields = decode_fields(await ctx.redis.hgetall(names.batch_record(team.team, batch_id)))
        if fields:
            data.append(batch_object(fields))
    return list_object(data, has_more)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, ctx: Context, team: Team) -> dict[str, Any]:
    return batch_object(await _batch(ctx, team.team, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, ctx: Context, team: Team) -> dict[str, Any]:
    fields = await _batch(ctx, team.team, batch_id)
    names = ctx.settings.names
    moved = await transition(
        ctx.redis, names, team.team, batch_id, tuple(s.value for s in CANCELLABLE), Status.CANCELLING,
        cancelling_at=str(int(time.time())),
    )  # fmt: skip
    fields = await _batch(ctx, team.team, batch_id)
    if not moved and fields["status"] not in (Status.CANCELLING, Status.CANCELLED):
        raise InvalidRequest(
            f"Cannot cancel a batch with status '{fields['status']}'.", code="batch_not_cancellable"
        )
    return batch_object(fields)
