"""The back half of /v1/batches, run by every ingress: validates new batches, sends their lines to the
pools' batch topics, collects the answers into one output line per input line, cancels, expires and
finalizes. queue_schemas.batch_api holds the decisions; this module holds the loops.

A batch is moved along by whichever ingress holds its lease (a Redis key renewed each round), so a dead
ingress's batches are picked up by another within `LEASE_MS`. Lines are sent with ids fixed by the
batch and line number, and the cursor of sent lines is saved after the broker has them, so a line sent
twice by a keeper that died is the same submission to the dispatcher. Answers arrive on an internal
topic read by one consumer group of all ingresses; an answer is stored with HSETNX under its line
before its offset is committed, so a collector that dies re-reads answers it may have stored, and none
is lost or counted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from queue_schemas.batch import BatchAnswer, BatchSubmission, internal_request_id
from queue_schemas.batch_api import (
    FileRecord,
    InputLine,
    Status,
    Step,
    as_text,
    decode_fields,
    final_status,
    line_request_id,
    local_error_line,
    local_http_line,
    next_step,
    parse_line_request_id,
    read_input,
    result_file_id,
    split_results,
    succeeded,
    validation_errors,
)
from queue_schemas.codec import decode, encode
from queue_schemas.config import SluiceConfig
from queue_schemas.errors import SchemaError
from queue_schemas.health import Liveness, item_failed
from queue_schemas.keys import TeamKey
from queue_schemas.messages import CancelNotice
from queue_schemas.names import Names
from queue_schemas.object_store import ObjectStore
from queue_schemas.signing import load_private_key, new_signing_key, sign_record

log = structlog.get_logger("sluice.ingress.batches")

LEASE_MS = 15_000
SUBMIT_CHUNK = 500  # lines sent per round per batch, then the cursor is saved
SERVICE_KEY_TTL_S = 8 * 24 * 3600  # longer than any line waits in a batch topic
RESULT_LINES_TTL_S = 24 * 3600  # the collected lines, kept a day after the files are written
CANCEL_MARK_TTL_MS = 10 * 60 * 1000
COLLECT_FETCH_WAIT_MS = 500

COLLECT_SCRIPT = """
-- KEYS: the batch's hash, its lines hash (one slot: the team's).
-- ARGV: line number, output line, '1' when the line succeeded.
-- Stores the line's first answer only; returns how many lines have one (-1: no such batch or line,
-- -2: the batch is past collecting).
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '-1')
local line = tonumber(ARGV[1])
if total < 0 or line >= total then return -1 end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' and status ~= 'validating' then return -2 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3] == '1' and 'completed' or 'failed', 1)
end
return redis.call('HLEN', KEYS[2])
"""

TRANSITION_SCRIPT = """
-- KEYS: the batch's hash. ARGV: statuses it may be in (comma-separated), the new status, then field /
-- value pairs to set with it. Returns 1 when moved, 0 when the batch was in another status.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == status then allowed = true end end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""


def collect_keys(names: Names, team: str, batch_id: str) -> list[str]:
    return [names.batch_record(team, batch_id), names.batch_lines(team, batch_id)]


def transition_keys(names: Names, team: str, batch_id: str) -> list[str]:
    return [names.batch_record(team, batch_id)]


async def transition(
    redis: aioredis.Redis,
    names: Names,
    team: str,
    batch_id: str,
    allowed: tuple[str, ...],
    to: Status,
    **fields: str,
) -> bool:
    """Move the batch to `to` if it is in one of `allowed`, setting `fields` with it."""
    keys = transition_keys(names, team, batch_id)
    pairs = [x for item in fields.items() for x in item]
    moved = await redis.eval(TRANSITION_SCRIPT, len(keys), *keys, ",".join(allowed), to.value, *pairs)
    return bool(moved)


class BatchKeeper:
    def __init__(
        self,
        names: Names,
        pools: SluiceConfig,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        store: ObjectStore,
        kafka_options: dict[str, Any],
        interval_s: float,
        liveness: Liveness | None = None,
    ) -> None:
        self.names = names
        self.liveness = liveness or Liveness()
        self.pools = pools
        self.redis = redis
        self.producer = producer
        self.store = store
        # Answers may wait half a second: a long poll keeps an idle collector cheap for the broker.
        self._kafka_options = {
            **kafka_options,
            "fetch_max_wait_ms": max(int(kafka_options.get("fetch_max_wait_ms", 0)), COLLECT_FETCH_WAIT_MS),
        }
        self.interval_s = interval_s
        self.holder = secrets.token_hex(8)
        pem, self._public, self.key_id = new_signing_key()
        self._private = load_private_key(pem)
        self._inputs: dict[str, list[InputLine]] = {}  # batch id -> its lines, while this keeper sends them
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._forever(self._keep_round, "keeping batches"), name="batch-keeper"),
            asyncio.create_task(self._collect(), name="batch-collector"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _register_key(self) -> None:
        """This process signs the lines it sends; dispatchers find its public key here."""
        await self.redis.set(self.names.service_signing_key(self.key_id), self._public, ex=SERVICE_KEY_TTL_S)

    async def _forever(self, round_: Any, what: str) -> None:
        registered: float | None = None  # the key is registered before the first line is signed
        while True:
            try:
                if registered is None or time.monotonic() - registered > 3600:
                    await self._register_key()
                    registered = time.monotonic()
                await round_()
            except (RedisError, KafkaError, OSError) as exc:
                log.warning(f"{what} failed; retrying", error=str(exc))
            await asyncio.sleep(self.interval_s)

    # keeping

    async def _keep_round(self) -> None:
        for member in await self.redis.smembers(self.names.active_batches()):
            team, _, batch_id = as_text(member).partition("/")
            if await self._leased(team, batch_id):
                await self._step(team, batch_id)

    async def _leased(self, team: str, batch_id: str) -> bool:
        key = self.names.batch_lease(team, batch_id)
        if await self.redis.set(key, self.holder, nx=True, px=LEASE_MS):
            return True
        holder = await self.redis.get(key)
        if holder is not None and as_text(holder) == self.holder:
            await self.redis.pexpire(key, LEASE_MS)
            return True
        self._inputs.pop(batch_id, None)  # another keeper has it now
        return False

    async def _step(self, team: str, batch_id: str) -> None:
        names = self.names
        fields = decode_fields(await self.redis.hgetall(names.batch_record(team, batch_id)))
        if not fields:
            await self._retire(team, batch_id)
            return
        answered = int(await self.redis.hlen(names.batch_lines(team, batch_id)))
        step = next_step(fields, answered, time.time())
        if step is Step.VALIDATE:
            await self._validate(team, batch_id, fields)
        elif step is Step.SUBMIT:
            await self._submit(team, batch_id, fields)
        elif step is Step.CANCEL:
            await self._cancel(team, batch_id, fields)
        elif step is Step.CLOSE_CANCELLED:
            await self._answer_rest(team, batch_id, fields, "cancelled", "The batch was cancelled.")
        elif step is Step.EXPIRE:
            await self.redis.hset(names.batch_record(team, batch_id), "expired", "1")
            await self._cancel_sent(team, batch_id, fields)
            message = "This request could not be executed before the completion window expired."
            await self._answer_rest(team, batch_id, fields, "batch_expired", message)
        elif step is Step.FINALIZE:
            await self._finalize(team, batch_id, fields)
        elif step is Step.DONE:
            await self._retire(team, batch_id)

    async def _retire(self, team: str, batch_id: str) -> None:
        self._inputs.pop(batch_id, None)
        await self.redis.srem(self.names.active_batches(), f"{team}/{batch_id}")
        await self.redis.delete(self.names.batch_lease(team, batch_id))

    async def _input(self, team: str, fields: dict[str, str]) -> list[InputLine] | str:
        """The batch's input lines (kept while this keeper sends them), or why there are none."""
        cached = self._inputs.get(fields["id"])
        if cached is not None:
            return cached
        raw = await self.redis.get(self.names.file_record(team, fields["input_file_id"]))
        if raw is None:
            return f"The input file {fields['input_file_id']} was deleted."
        record = FileRecord.model_validate_json(raw)
        try:
            data = await self.store.get(record.key)
        except FileNotFoundError:
            return f"The input file {record.id} is missing from the file store."
        lines = read_input(data)
        if not isinstance(lines, str):
            self._inputs[fields["id"]] = lines
        return lines

    async def _validate(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        lines = await self._input(team, fields)
        now = str(int(time.time()))
        problem: tuple[str, int | None] | None = None
        if isinstance(lines, str):
            problem = lines, None
        else:
            wrong = next((line for line in lines if line.url != fields["endpoint"]), None)
            if wrong is not None:
                message = f"The url {wrong.url} does not match the batch's endpoint {fields['endpoint']}."
                problem = message, wrong.number + 1
        if problem is not None:
            errors = validation_errors(problem[0], "input_file_id", problem[1])
            await transition(
                self.redis, self.names, team, batch_id, (Status.VALIDATING,), Status.FAILED,
                failed_at=now, errors=errors,
            )  # fmt: skip
            return
        assert not isinstance(lines, str)
        await transition(
            self.redis, self.names, team, batch_id, (Status.VALIDATING,), Status.IN_PROGRESS,
            in_progress_at=now, total=str(len(lines)),
        )  # fmt: skip

    async def _submit(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        lines = await self._input(team, fields)
        if isinstance(lines, str):  # the file went away after validation: what is left cannot run
            await self._answer_rest(team, batch_id, fields, "input_file_missing", lines)
            return
        key = TeamKey.model_validate_json(fields["key"])
        cursor = int(fields["cursor"])
        end = min(len(lines), cursor + SUBMIT_CHUNK)
        now = time.time()
        window = max(1.0, float(fields["expires_at"]) - now)
        sends = []
        for number in range(cursor, end):
            line = lines[number]
            model = str(line.body["model"])
            pool = self.pools.pool_for_model(model)
            adapter = model if pool is not None and model != pool.model else None
            if pool is None or not key.allows_model(pool.name, adapter):  # as the HTTP routes answer
                message = f"The model '{model}' does not exist or you do not have access to it."
                error = {"message": message, "type": "invalid_request_error", "param": "model"}
                error["code"] = "model_not_found"
                out = local_http_line(team, batch_id, number, line.custom_id, 404, {"error": error})
                await self._store_line(team, batch_id, number, out)
                continue
            submission = BatchSubmission(
                request_id=line_request_id(team, batch_id, number), custom_id=line.custom_id, team=team,
                reply_topic=self.names.batch_api_answers_topic(), url=line.url,  # type: ignore[arg-type]
                body=line.body, completion_window_s=window, submitted_at=now, key_id=fields.get("key_id"),
            )  # fmt: skip
            value = submission.model_dump_json(exclude_none=True).encode()
            sends.append(
                await self.producer.send(
                    self.names.batch_topic(pool.name),
                    value,
                    key=submission.request_id.encode(),
                    headers=sign_record(self._private, value),
                )
            )
        await asyncio.gather(*sends)
        await self.redis.hset(self.names.batch_record(team, batch_id), "cursor", str(end))
        if end >= len(lines):
            self._inputs.pop(batch_id, None)

    async def _store_line(self, team: str, batch_id: str, number: int, line: dict[str, Any]) -> int:
        keys = collect_keys(self.names, team, batch_id)
        ok = "1" if succeeded(line) else "0"
        stored = await self.redis.eval(COLLECT_SCRIPT, len(keys), *keys, number, json.dumps(line), ok)
        return int(stored)

    async def _answered(self, team: str, batch_id: str) -> set[int]:
        numbers = await self.redis.hkeys(self.names.batch_lines(team, batch_id))
        return {int(n) for n in numbers}

    async def _cancel(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        """Lines not sent yet are answered as cancelled here; sent ones are cancelled where they are
        (the dispatcher or worker answers each `cancelled`, or with its result if it had finished)."""
        total, cursor = int(fields["total"]), int(fields["cursor"])
        message = "The batch was cancelled before this request was sent."
        lines = await self._input(team, fields) if cursor < total else []
        for number in range(cursor, total):
            custom_id = lines[number].custom_id if not isinstance(lines, str) else f"line-{number + 1}"
            out = local_error_line(team, batch_id, number, custom_id, "cancelled", message)
            await self._store_line(team, batch_id, number, out)
        record = self.names.batch_record(team, batch_id)
        await self.redis.hset(record, "cursor", str(total))
        await self._cancel_sent(team, batch_id, fields)
        await self.redis.hset(record, "cancel_sent", "1")
        self._inputs.pop(batch_id, None)

    async def _cancel_sent(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        """Cancel notices for every sent line without an answer."""
        answered = await self._answered(team, batch_id)
        names = self.names
        now = time.time()
        pending = [n for n in range(int(fields["cursor"])) if n not in answered]
        for start in range(0, len(pending), SUBMIT_CHUNK):
            async with self.redis.pipeline(transaction=False) as pipe:
                for number in pending[start : start + SUBMIT_CHUNK]:
                    rid = internal_request_id(team, line_request_id(team, batch_id, number))
                    notice = CancelNotice(request_id=rid, reason="batch cancelled", sent_at=now)
                    pipe.set(names.cancelled(rid), "batch cancelled", px=CANCEL_MARK_TTL_MS)
                    pipe.execute_command("PUBLISH", names.cancel_channel(), encode(notice))
                await pipe.execute()

    async def _answer_rest(
        self, team: str, batch_id: str, fields: dict[str, str], code: str, message: str
    ) -> None:
        """Answer every line without an answer yet with an error of the keeper's own."""
        answered = await self._answered(team, batch_id)
        lines = await self._input(team, fields)
        for number in range(int(fields["total"])):
            if number in answered:
                continue
            custom_id = lines[number].custom_id if not isinstance(lines, str) else f"line-{number + 1}"
            await self._store_line(
                team, batch_id, number, local_error_line(team, batch_id, number, custom_id, code, message)
            )
        await self.redis.hset(self.names.batch_record(team, batch_id), "cursor", fields["total"])

    async def _finalize(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        names = self.names
        now = str(int(time.time()))
        status = fields["status"]
        if status != Status.FINALIZING:
            ending = final_status(status, expired=bool(fields.get("expired")))
            moved = await transition(
                self.redis, names, team, batch_id, (Status.IN_PROGRESS, Status.CANCELLING), Status.FINALIZING,
                finalizing_at=now, ending=ending.value,
            )  # fmt: skip
            if not moved:
                return  # cancelled meanwhile: the next round decides again
            fields = decode_fields(await self.redis.hgetall(names.batch_record(team, batch_id)))
        raw = await self.redis.hgetall(names.batch_lines(team, batch_id))
        output, errors = split_results({int(k): as_text(v) for k, v in raw.items()})
        ids: dict[str, str] = {}
        for kind, data in (("output", output), ("errors", errors)):
            if not data:
                continue
            file_id = result_file_id(batch_id, kind)
            record = FileRecord(
                id=file_id, team=team, purpose="batch_output", filename=f"{batch_id}_{kind}.jsonl",
                bytes=len(data), created_at=int(now), key=f"files/{team}/{file_id}",
            )  # fmt: skip
            await self.store.put(record.key, data)
            await self.redis.set(names.file_record(team, file_id), record.model_dump_json())
            await self.redis.zadd(names.files(team), {file_id: float(now)})
            ids["output_file_id" if kind == "output" else "error_file_id"] = file_id
        ending = Status(fields.get("ending") or Status.COMPLETED)
        await transition(
            self.redis,
            names,
            team,
            batch_id,
            (Status.FINALIZING,),
            ending,
            **{f"{ending.value}_at": now},
            **ids,
        )
        await self.redis.expire(names.batch_lines(team, batch_id), RESULT_LINES_TTL_S)
        await self._retire(team, batch_id)
        log.info("batch finalized", batch_id=batch_id, team=team, status=ending.value)

    # collecting

    async def _collect(self) -> None:
        """Answers of every batch's lines, from the internal answers topic, into their batches."""
        while True:
            consumer = AIOKafkaConsumer(self.names.batch_api_answers_topic(), **self._kafka_options)
            try:
                await consumer.start()
                while True:
                    batches = await consumer.getmany(timeout_ms=500, max_records=500)
                    for records in batches.values():
                        for record in records:
                            await self._collect_one(record.value or b"")
                    if batches:
                        await consumer.commit()
            except (RedisError, KafkaError, OSError) as exc:
                log.warning("collecting answers failed; reconnecting", error=str(exc))
            finally:
                with contextlib.suppress(KafkaError, OSError):
                    await consumer.stop()
            await asyncio.sleep(self.interval_s)

    async def _collect_one(self, value: bytes) -> None:
        try:
            answer = decode(BatchAnswer, value)
        except SchemaError as exc:
            log.error("an answer on the batch answers topic is not one", error=str(exc))
            return
        where = parse_line_request_id(answer.request_id)
        if where is None:
            log.error("an answer names no line of a batch", request_id=answer.request_id)
            return
        team, batch_id, number = where
        stored = await self._store_line(team, batch_id, number, answer.output_line())
        if stored == -1:
            log.warning("an answer for no known batch line", batch_id=batch_id, line=number)
