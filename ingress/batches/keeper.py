"""The back half of /v1/batches, run by every ingress: validates new batches, sends their lines to the
pools' batch topics, collects the answers into one output line per input line, cancels, expires and
finalizes. ingress.batches.api holds the decisions; this module holds the loops.

A batch is moved along by whichever ingress holds its lease (a Redis key renewed each round), so a dead
ingress's batches are picked up by another within `LEASE_MS`. Lines are sent with ids fixed by the
batch and line number, and the cursor of sent lines is saved after the broker has them, so a line sent
twice by a keeper that died is the same submission to the dispatcher. Answers arrive on an internal
topic read by one consumer group of all ingresses; an answer is stored with HSETNX under its line
before its offset is committed, so a collector that dies re-reads answers it may have stored, and none
is lost or counted twice.

Input files are read a window at a time from the byte offset saved with the cursor, and result files
written a page at a time (ingress.batches.files), so no batch is held whole in memory. A batch whose step
raises (other than on a Redis or broker outage, which the round retries) is retried a few rounds, then
failed with the reason; the other batches go on. A batch whose API key was revoked is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress.batches.api import (
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
    object_key,
    result_file_id,
    succeeded,
    validation_errors,
)
from ingress.batches.collector import AnswerCollector, store_line
from ingress.batches.files import lines_from, read_window, write_results
from ingress.batches.object_store import ObjectStore
from ingress.settings import IngressSettings
from ingress.team_caps import BATCH_LINES, BATCHES, BYTES, FILES, TeamCaps, TeamStorage
from plumbing import tracing
from plumbing.health import Liveness, item_failed
from plumbing.protocol.batches import COLLECT_SCRIPT, TRANSITION_SCRIPT, collect_keys, transition_keys
from plumbing.protocol.leases import LEASE_SCRIPT
from plumbing.protocol.request import cancel
from plumbing.tasks import stop_tasks
from queue_schemas.batch import BatchSubmission, internal_request_id
from queue_schemas.config import SluiceConfig
from queue_schemas.keys import TeamKey
from queue_schemas.names import Names
from queue_schemas.signing import load_private_key, new_signing_key, sign_record

log = structlog.get_logger("sluice.ingress.batches")

LEASE_MS = 15_000
SUBMIT_CHUNK = 500  # lines sent per round per batch, then the cursor is saved
# Lines, or bytes of input, handled between two turns given back to the event loop, and the keeper's own
# answers stored per round trip: a batch of many (or large) lines never holds the loop other teams' streams
# run on.
LINES_PER_TURN = 50
BYTES_PER_TURN = 256 * 1024
ANSWER_PAGE = 100
SERVICE_KEY_TTL_S = 8 * 24 * 3600  # longer than any line waits in a batch topic
RESULT_LINES_TTL_S = 600  # the collected lines, kept a while after the files are written
STEP_FAULTS = 3  # rounds in a row a batch's step may raise before the batch is failed
KEEPER_STALE_S = 120.0  # /healthz: a keeper with no finished round for this long is stuck
SWEEP_PAGE = 100  # expired files removed per round


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
        caps: TeamCaps | None = None,
        file_expiry_s: int = 30 * 24 * 3600,
        batch_retain_s: int = 30 * 24 * 3600,
    ) -> None:
        self.names = names
        self.liveness = liveness or Liveness()
        self.pools = pools
        self.redis = redis
        self.producer = producer
        self.store = store
        self.storage = TeamStorage(redis, names, caps or IngressSettings.model_construct().team_caps())
        self.file_expiry_s = file_expiry_s
        self.batch_retain_s = batch_retain_s
        self.interval_s = interval_s
        self._lease = redis.register_script(LEASE_SCRIPT)
        self.collector = AnswerCollector(redis, names, kafka_options, interval_s, self.liveness)
        self.holder = secrets.token_hex(8)
        pem, self._public, self.key_id = new_signing_key()
        self._private = load_private_key(pem)
        self._faults: dict[str, int] = {}  # batch id -> rounds in a row its step raised
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._forever(self._keep_round, "keeping batches"), name="batch-keeper"),
            asyncio.create_task(self.collector.run(), name="batch-collector"),
        ]
        self.liveness.watch("batch-keeper", self._tasks[0], stale_after_s=KEEPER_STALE_S)
        self.liveness.watch("batch-collector", self._tasks[1])

    async def close(self) -> None:
        for task in self._tasks:
            self.liveness.forget(task.get_name())
        await stop_tasks(self._tasks)

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
                self.liveness.beat("batch-keeper")
            except (RedisError, KafkaError, OSError) as exc:
                log.warning(f"{what} failed; retrying", error=str(exc))
            await asyncio.sleep(self.interval_s)

    # keeping

    async def _keep_round(self) -> None:
        for member in await self.redis.smembers(self.names.active_batches()):
            team, _, batch_id = as_text(member).partition("/")
            if await self._leased(team, batch_id):
                await self._step_alone(team, batch_id)
        await self._sweep_files()

    async def _step_alone(self, team: str, batch_id: str) -> None:
        """One batch's step; what it raises is that batch's alone (an outage is the round's)."""
        try:
            await self._step(team, batch_id)
        except FileNotFoundError as exc:  # an object of this batch's is gone: not an outage
            await self._step_failed(team, batch_id, exc)
        except (RedisError, KafkaError, OSError):
            raise
        except Exception as exc:
            await self._step_failed(team, batch_id, exc)
        else:
            self._faults.pop(batch_id, None)

    async def _step_failed(self, team: str, batch_id: str, exc: Exception) -> None:
        faults = self._faults.get(batch_id, 0) + 1
        self._faults[batch_id] = faults
        log.error(
            "batch step failed", batch_id=batch_id, team=team, faults=faults,
            error=type(exc).__name__, exc_info=exc,
        )  # fmt: skip
        if faults >= STEP_FAULTS:
            item_failed("ingress.batch_keeper")
            await self._fail(team, batch_id, f"The batch could not be processed ({type(exc).__name__}).")

    async def _fail(self, team: str, batch_id: str, message: str) -> None:
        """End a batch that cannot go on: failed, with the reason in its errors."""
        now = str(int(time.time()))
        statuses = (Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING)
        await transition(
            self.redis, self.names, team, batch_id, statuses, Status.FAILED,
            failed_at=now, errors=validation_errors(message),
        )  # fmt: skip
        await self._retire(team, batch_id)
        self._faults.pop(batch_id, None)

    async def _leased(self, team: str, batch_id: str, action: str = "claim") -> bool:
        """Whether this keeper holds the batch's lease, claimed if free or renewed if its own, in one
        script (the dispatchers' partition leases); `action` 'renew' only renews."""
        key = self.names.batch_lease(team, batch_id)
        held = await self._lease(keys=[key], args=[self.holder, LEASE_MS, action])
        return bool(held[0])

    async def _step(self, team: str, batch_id: str) -> None:
        names = self.names
        fields = decode_fields(await self.redis.hgetall(names.batch_record(team, batch_id)))
        if not fields:
            await self._retire(team, batch_id)
            return
        if await self._key_revoked(fields):
            await transition(
                self.redis, names, team, batch_id, CANCELLABLE_STATUSES, Status.CANCELLING,
                cancelling_at=str(int(time.time())), cancel_reason=KEY_REVOKED,
            )  # fmt: skip
            fields = decode_fields(await self.redis.hgetall(names.batch_record(team, batch_id)))
        answered = int(await self.redis.hlen(names.batch_lines(team, batch_id)))
        step = next_step(fields, answered, time.time())
        if step is Step.VALIDATE:
            await self._validate(team, batch_id, fields)
        elif step is Step.SUBMIT:
            await self._submit(team, batch_id, fields)
        elif step is Step.CANCEL:
            await self._cancel(team, batch_id, fields)
        elif step is Step.CLOSE_CANCELLED:
            reason = fields.get("cancel_reason") or "The batch was cancelled."
            await self._answer_rest(team, batch_id, fields, "cancelled", reason)
        elif step is Step.EXPIRE:
            await self.redis.hset(names.batch_record(team, batch_id), "expired", "1")
            await self._cancel_sent(team, batch_id, fields)
            message = "This request could not be executed before the completion window expired."
            await self._answer_rest(team, batch_id, fields, "batch_expired", message)
        elif step is Step.FINALIZE:
            await self._finalize(team, batch_id, fields)
        elif step is Step.DONE:
            await self._retire(team, batch_id)

    async def _key_revoked(self, fields: dict[str, str]) -> bool:
        """Whether the API key that created a batch still in progress has been revoked since."""
        key_hash = fields.get("key_hash")
        if not key_hash or fields.get("status") not in CANCELLABLE_STATUSES:
            return False
        return not await self.redis.exists(self.names.api_key(key_hash))

    async def _retire(self, team: str, batch_id: str) -> None:
        """A batch that ended, however it ended: its share of the caps given back once, its record kept
        for the retention time and its answered lines a while longer (the result files hold them)."""
        names = self.names
        record = names.batch_record(team, batch_id)
        total = await self.redis.hget(record, "total")
        if await self.redis.hdel(record, "capped"):  # once, whoever retires it
            await self.storage.give(team, {BATCHES: 1, BATCH_LINES: int(total or 0)})
        await self.redis.expire(names.batch_lines(team, batch_id), RESULT_LINES_TTL_S)
        await self.redis.expire(record, self.batch_retain_s)
        await self.redis.srem(names.active_batches(), f"{team}/{batch_id}")
        await self.redis.delete(names.batch_lease(team, batch_id))

    async def _input(self, team: str, fields: dict[str, str]) -> FileRecord | str:
        """The batch's input file record, or why there is none."""
        raw = await self.redis.get(self.names.file_record(team, fields["input_file_id"]))
        if raw is None:
            return f"The input file {fields['input_file_id']} was deleted."
        return FileRecord.model_validate_json(raw)

    async def _validate(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        """The file's lines were checked at upload; what is left is that they all use the batch's url."""
        record = await self._input(team, fields)
        now = str(int(time.time()))
        problem: tuple[str, int | None] | None = None
        if isinstance(record, str):
            problem = record, None
        else:
            wrong = sorted((line, url) for url, line in record.endpoints.items() if url != fields["endpoint"])
            if wrong:
                line, url = wrong[0]
                problem = f"The url {url} does not match the batch's endpoint {fields['endpoint']}.", line
        if problem is not None:
            errors = validation_errors(problem[0], "input_file_id", problem[1])
            await transition(
                self.redis, self.names, team, batch_id, (Status.VALIDATING,), Status.FAILED,
                failed_at=now, errors=errors,
            )  # fmt: skip
            return
        assert not isinstance(record, str)
        await transition(
            self.redis, self.names, team, batch_id, (Status.VALIDATING,), Status.IN_PROGRESS,
            in_progress_at=now, total=str(record.lines),
        )  # fmt: skip

    async def _submit(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        record = await self._input(team, fields)
        if isinstance(record, str):  # the file went away after validation: what is left cannot run
            await self._answer_rest(team, batch_id, fields, "input_file_missing", record)
            return
        key = TeamKey.model_validate_json(fields["key"])
        cursor, offset = int(fields["cursor"]), int(fields.get("offset") or 0)
        total = int(fields["total"])
        window, after = await read_window(self.store, record, offset, min(SUBMIT_CHUNK, total - cursor))
        if after <= offset:
            raise ValueError(f"no whole line at byte {offset} of the batch's input file")
        if not window:  # only blank lines in this window: step past them
            await self.redis.hset(self.names.batch_record(team, batch_id), "offset", str(after))
            return
        now = time.time()
        sent: list[tuple[int, InputLine, int, asyncio.Future[Any] | BaseException]] = []
        turned_at, lines_since, start = offset, 0, offset  # start: this line's first byte
        for number, (line, end) in enumerate(window, start=cursor):
            if lines_since >= LINES_PER_TURN or end - turned_at > BYTES_PER_TURN:
                await asyncio.sleep(0)
                turned_at, lines_since = start, 0
            lines_since, start = lines_since + 1, end
            submission = self._submission(team, batch_id, number, line, key, fields, now)
            if isinstance(submission, dict):  # answered here: its model is not served to this key
                await self._store_line(team, batch_id, number, submission)
                sent.append((number, line, end, _done()))
                continue
            request, pool = submission
            value = request.model_dump_json(exclude_none=True).encode()
            headers = sign_record(self._private, value) + line_trace(request, batch_id, pool, number)
            try:
                future = await self.producer.send(
                    self.names.batch_topic(pool), value, key=request.request_id.encode(), headers=headers
                )
            except KafkaError as exc:
                if exc.retriable:
                    raise
                sent.append((number, line, end, exc))
                continue
            sent.append((number, line, end, future))
        cursor, offset = await self._settle_sends(team, batch_id, sent, cursor, offset)
        await self.redis.hset(
            self.names.batch_record(team, batch_id), mapping={"cursor": str(cursor), "offset": str(offset)}
        )

    def _submission(
        self, team: str, batch_id: str, number: int, line: InputLine, key: TeamKey,
        fields: dict[str, str], now: float,
    ) -> tuple[BatchSubmission, str] | dict[str, Any]:  # fmt: skip
        """The record to send for a line, or its answer when its model is not one the key may use (as
        the HTTP routes answer)."""
        model = str(line.body["model"])
        pool = self.pools.pool_for_model(model)
        adapter = model if pool is not None and model != pool.model else None
        if pool is None or not key.allows_model(pool.name, adapter):
            message = f"The model '{model}' does not exist or you do not have access to it."
            error = {"message": message, "type": "invalid_request_error", "param": "model"}
            error["code"] = "model_not_found"
            return local_http_line(team, batch_id, number, line.custom_id, 404, {"error": error})
        window = max(1.0, float(fields["expires_at"]) - now)
        request = BatchSubmission(
            request_id=line_request_id(team, batch_id, number), custom_id=line.custom_id, team=team,
            reply_topic=self.names.batch_api_answers_topic(), url=line.url,  # type: ignore[arg-type]
            body=line.body, completion_window_s=window, submitted_at=now, key_id=fields.get("key_id"),
        )  # fmt: skip
        return request, pool.name

    async def _settle_sends(
        self,
        team: str,
        batch_id: str,
        sent: list[tuple[int, InputLine, int, asyncio.Future[Any] | BaseException]],
        cursor: int,
        offset: int,
    ) -> tuple[int, int]:
        """Wait for the broker's word on each line sent. A line the broker refused for good (too large,
        say) is answered with the reason and the batch goes on; at the first line it could not take for
        now, the cursor stops (that line and those after it are sent again next round, under the same
        ids)."""
        outcomes = await asyncio.gather(*(_outcome(item[3]) for item in sent), return_exceptions=True)
        for (number, line, end, _), outcome in zip(sent, outcomes, strict=True):
            if isinstance(outcome, KafkaError) and not outcome.retriable:
                message = f"The request could not be queued: {type(outcome).__name__}."
                out = local_error_line(team, batch_id, number, line.custom_id, "enqueue_failed", message)
                await self._store_line(team, batch_id, number, out)
            elif isinstance(outcome, BaseException):
                log.warning("a batch line was not taken by the broker yet", batch_id=batch_id, line=number,
                            error=type(outcome).__name__)  # fmt: skip
                return cursor, offset
            cursor, offset = number + 1, end
        return cursor, offset

    async def _store_line(self, team: str, batch_id: str, number: int, line: dict[str, Any]) -> int:
        return await store_line(self.redis, self.names, team, batch_id, number, line)

    async def _answered(self, team: str, batch_id: str) -> set[int]:
        numbers = await self.redis.hkeys(self.names.batch_lines(team, batch_id))
        return {int(n) for n in numbers}

    async def _cancel(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        """Lines not sent yet are answered as cancelled here; sent ones are cancelled where they are
        (the dispatcher or worker answers each `cancelled`, or with its result if it had finished)."""
        total, cursor = int(fields["total"]), int(fields["cursor"])
        reason = fields.get("cancel_reason") or "The batch was cancelled before this request was sent."
        if cursor < total:
            await self._answer_from(team, batch_id, fields, cursor, "cancelled", reason, set())
        record = self.names.batch_record(team, batch_id)
        await self.redis.hset(record, "cursor", str(total))
        await self._cancel_sent(team, batch_id, fields)
        await self.redis.hset(record, "cancel_sent", "1")

    async def _cancel_sent(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        """Cancel notices for every sent line without an answer."""
        answered = await self._answered(team, batch_id)
        names = self.names
        now = time.time()
        pending = [n for n in range(int(fields["cursor"])) if n not in answered]
        for start in range(0, len(pending), ANSWER_PAGE):
            async with self.redis.pipeline(transaction=False) as pipe:
                for number in pending[start : start + ANSWER_PAGE]:
                    rid = internal_request_id(team, line_request_id(team, batch_id, number))
                    cancel(pipe, names, rid, "batch cancelled", now)
                await pipe.execute()

    async def _answer_rest(
        self, team: str, batch_id: str, fields: dict[str, str], code: str, message: str
    ) -> None:
        """Answer every line without an answer yet with an error of the keeper's own."""
        answered = await self._answered(team, batch_id)
        await self._answer_from(team, batch_id, fields, 0, code, message, answered)
        await self.redis.hset(self.names.batch_record(team, batch_id), "cursor", fields["total"])

    async def _answer_from(
        self, team: str, batch_id: str, fields: dict[str, str], first: int, code: str, message: str,
        answered: set[int],
    ) -> None:  # fmt: skip
        """Answer lines `first` on that are not in `answered` with the keeper's own error, reading their
        custom ids from the input file (or naming them by number if it is gone)."""
        total = int(fields["total"])
        record = await self._input(team, fields)
        page: list[tuple[int, dict[str, Any]]] = []
        if isinstance(record, str):
            for number in range(first, total):
                if number not in answered:
                    page.append(
                        (
                            number,
                            local_error_line(team, batch_id, number, f"line-{number + 1}", code, message),
                        )
                    )
                if len(page) >= ANSWER_PAGE:
                    await self._store_page(team, batch_id, page)
            await self._store_page(team, batch_id, page)
            return
        start = int(fields.get("offset") or 0) if first == int(fields["cursor"]) else 0
        number = first if start else 0
        async for line in lines_from(self.store, record, start):
            if number >= first and number not in answered:
                page.append((number, local_error_line(team, batch_id, number, line.custom_id, code, message)))
                if len(page) >= ANSWER_PAGE:
                    await self._store_page(team, batch_id, page)
            number += 1
        await self._store_page(team, batch_id, page)

    async def _store_page(self, team: str, batch_id: str, page: list[tuple[int, dict[str, Any]]]) -> None:
        """Store a page of the keeper's own answers in one round trip, then hold on to the batch's lease
        (a batch of many lines takes many pages). The page is emptied."""
        keys = collect_keys(self.names, team, batch_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            for number, line in page:
                pipe.eval(
                    COLLECT_SCRIPT,
                    len(keys),
                    *keys,
                    number,
                    json.dumps(line),
                    "1" if succeeded(line) else "0",
                )
            await pipe.execute()
        page.clear()
        await self._leased(team, batch_id, "renew")

    async def _finalize(self, team: str, batch_id: str, fields: dict[str, str]) -> None:
        names = self.names
        now = int(time.time())
        status = fields["status"]
        if status != Status.FINALIZING:
            ending = final_status(status, expired=bool(fields.get("expired")))
            moved = await transition(
                self.redis, names, team, batch_id, (Status.IN_PROGRESS, Status.CANCELLING), Status.FINALIZING,
                finalizing_at=str(now), ending=ending.value,
            )  # fmt: skip
            if not moved:
                return  # cancelled meanwhile: the next round decides again
            fields = decode_fields(await self.redis.hgetall(names.batch_record(team, batch_id)))
        ids = await self._write_results(team, batch_id, fields, now)
        ending = Status(fields.get("ending") or Status.COMPLETED)
        await transition(
            self.redis, names, team, batch_id, (Status.FINALIZING,), ending,
            **{f"{ending.value}_at": str(now)}, **ids,
        )  # fmt: skip
        await self._retire(team, batch_id)
        log.info("batch finalized", batch_id=batch_id, team=team, status=ending.value)

    async def _write_results(
        self, team: str, batch_id: str, fields: dict[str, str], now: int
    ) -> dict[str, str]:
        """The output and error files, written a page of lines at a time; their ids by field."""
        names = self.names
        lines_key = names.batch_lines(team, batch_id)
        file_ids = {kind: result_file_id(batch_id, kind) for kind in ("output", "errors")}
        keys = (object_key(team, file_ids["output"]), object_key(team, file_ids["errors"]))

        async def read(numbers: list[int]) -> list[str | None]:
            raw = await self.redis.hmget(lines_key, [str(n) for n in numbers])
            return [None if r is None else as_text(r) for r in raw]

        sizes = await write_results(self.store, keys, int(fields["total"]), read)
        seconds = int(fields.get("output_expires_s") or self.file_expiry_s)
        ids: dict[str, str] = {}
        for kind, key, size in zip(("output", "errors"), keys, sizes, strict=True):
            if not size:
                continue
            file_id = file_ids[kind]
            if await self.redis.exists(names.file_record(team, file_id)):
                ids["output_file_id" if kind == "output" else "error_file_id"] = file_id
                continue  # written by a keeper that died before the batch moved on
            record = FileRecord(
                id=file_id, team=team, purpose="batch_output", filename=f"{batch_id}_{kind}.jsonl",
                bytes=size, created_at=now, key=key, expires_at=now + seconds,
            )  # fmt: skip
            # Counted once, however many keepers write it (one may die after counting, before saving).
            if await self.redis.hsetnx(names.batch_record(team, batch_id), f"{kind}_counted", "1"):
                await self.storage.take(team, {FILES: 1, BYTES: size}, capped=False)
            await save_file_record(self.redis, names, record)
            ids["output_file_id" if kind == "output" else "error_file_id"] = file_id
        return ids

    async def _sweep_files(self) -> None:
        """Remove files whose time is up (a page per round), giving their bytes back to their teams."""
        due = await self.redis.zrangebyscore(self.names.file_expiry(), 0, time.time(), 0, SWEEP_PAGE)
        for member in due:
            team, _, file_id = as_text(member).partition("/")  # type: ignore[arg-type]
            try:
                await remove_file(self.redis, self.names, self.store, self.storage, team, file_id)
            except (RedisError, OSError):
                raise  # an outage: the sweep goes on next round
            except Exception as exc:  # this entry's alone (a record that no longer reads): passed over
                item_failed("ingress.file_sweep")
                log.error("an expired file could not be removed", team=team, file_id=file_id,
                          error=type(exc).__name__, exc_info=exc)  # fmt: skip
                await self.redis.zrem(self.names.file_expiry(), f"{team}/{file_id}")


KEY_REVOKED = "The API key that created the batch was revoked."
CANCELLABLE_STATUSES = (Status.VALIDATING, Status.IN_PROGRESS)


def _done() -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


async def _outcome(sent: asyncio.Future[Any] | BaseException) -> Any:
    if isinstance(sent, BaseException):
        raise sent
    return await sent


async def save_file_record(redis: aioredis.Redis, names: Names, record: FileRecord) -> None:
    """Index a stored file: its record, the team's list, and the expiry sweep."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(names.file_record(record.team, record.id), record.model_dump_json())
        pipe.zadd(names.files(record.team), {record.id: record.created_at})
        if record.expires_at is not None:
            pipe.zadd(names.file_expiry(), {f"{record.team}/{record.id}": record.expires_at})
        await pipe.execute()


async def remove_file(
    redis: aioredis.Redis, names: Names, store: ObjectStore, storage: TeamStorage, team: str, file_id: str
) -> bool:
    """Remove a file (deleted or expired) and give its bytes back; False when it was gone already. The
    object goes first: when the store is out, nothing else has changed and the removal is tried again."""
    raw = await redis.get(names.file_record(team, file_id))
    record = None if raw is None else FileRecord.model_validate_json(raw)
    if record is not None:
        await store.delete(record.key)
    await redis.zrem(names.file_expiry(), f"{team}/{file_id}")
    await redis.zrem(names.files(team), file_id)
    if record is None or not await redis.delete(names.file_record(team, file_id)):
        return False  # another ingress removed it, and gave its bytes back
    await storage.give(team, {FILES: 1, BYTES: record.bytes})
    return True


def line_trace(request: BatchSubmission, batch_id: str, pool: str, number: int) -> list[tuple[str, bytes]]:
    """A batch line's trace starts as it is sent: its root span, named in the record's headers."""
    if not tracing.ENABLED:
        return []
    now = time.time()
    attributes = {
        tracing.REQUEST_ID: internal_request_id(request.team, request.request_id),
        tracing.TEAM: request.team,
        tracing.POOL: pool,
        "sluice.batch_id": batch_id,
        "sluice.batch_line": number,
    }
    return tracing.kafka_headers(tracing.record("batch line", tracing.new_trace(), now, now, attributes))
