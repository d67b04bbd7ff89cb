"""`sluice batch submit`: produce an OpenAI batch file to Kafka and collect its answers into an output file.

Submitting and collecting run side by side. Answers are read from the reply topic in a consumer group of
the batch's own, and its offsets are committed only after the lines are written and synced, so an
interrupted run loses nothing: the next run reads on from the last commit, skips custom ids already in
the output, and submits only the lines not yet sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import NewTopic
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from infra.batch_file import (
    Line,
    RunState,
    Tally,
    accept,
    batch_id_of,
    load_state,
    load_tally,
    local_error_line,
    read_lines,
    save_state,
)
from infra.topics import RESULTS_PARTITIONS, create_missing
from plumbing.clients import consumer_options, producer_options
from plumbing.deadletter import send_dead_letter
from queue_schemas.batch import BatchAnswer
from queue_schemas.codec import decode, encode
from queue_schemas.errors import SchemaError
from queue_schemas.settings import BusSettings
from queue_schemas.signing import sign_record

log = structlog.get_logger("sluice.batch")
SUBMIT_CHUNK = 200
Progress = Callable[[RunState, Tally], None]


class BatchInputError(ValueError):
    """The input or output file cannot be used as given."""


def prepare(
    settings: BusSettings,
    input_path: Path,
    output: Path,
    team: str,
    reply_topic: str | None,
    window_s: float | None,
) -> tuple[RunState, list[Line], Tally]:
    data = input_path.read_bytes()
    batch_id = batch_id_of(data)
    state = load_state(output)
    if state is None and output.exists():
        raise BatchInputError(
            f"{output} exists and is not the output of a sluice batch run; choose another --output"
        )
    if state is not None and state.batch_id != batch_id:
        raise BatchInputError(
            f"{output} holds the answers of another input ({state.input}); choose another --output"
        )
    if state is not None:  # a resumed run keeps the team and reply topic it started with
        team, topic = state.team, state.reply_topic
    else:
        topic = reply_topic or settings.names.results_topic(team)
    lines = read_lines(data, batch_id, team, topic, settings.load_pools(), window_s)
    if not lines:
        raise BatchInputError(f"{input_path} has no lines")
    state = state or RunState(batch_id, str(input_path), topic, team, total=len(lines))
    return state, lines, load_tally(output)


async def ensure_topic(settings: BusSettings, topic: str) -> None:
    await create_missing(settings, [NewTopic(topic, RESULTS_PARTITIONS, 1)])


async def run_batch(
    settings: BusSettings,
    output: Path,
    state: RunState,
    lines: list[Line],
    tally: Tally,
    progress: Progress,
    stop: asyncio.Event,
    signer: Ed25519PrivateKey,
) -> Tally:
    """Submit what is left, each record signed with the team's key, and collect until every line is
    answered or `stop` is set."""
    save_state(output, state)
    await ensure_topic(settings, state.reply_topic)
    group = settings.names.batch_collector_group(state.team, state.batch_id)
    consumer = AIOKafkaConsumer(state.reply_topic, **consumer_options(settings, group))
    producer = AIOKafkaProducer(**producer_options(settings))
    await consumer.start()
    await producer.start()
    try:
        with output.open("a") as out:
            submitter = asyncio.create_task(
                _submit(settings, producer, signer, output, state, lines, tally, out)
            )
            try:
                letters = DeadLetters(producer, settings.names.deadletter_topic(), group)
                await _collect(consumer, output, state, tally, out, progress, stop, submitter, letters)
            finally:
                submitter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await submitter
                save_state(output, state)
    finally:
        await producer.stop()
        await consumer.stop()
    return tally


@dataclass
class DeadLetters:
    """Records of the reply topic that are not answers go to the dead-letter topic, like any consumer's."""

    producer: AIOKafkaProducer
    topic: str
    consumer: str

    async def send(self, record: ConsumerRecord[Any, Any], reason: str) -> None:
        await send_dead_letter(self.producer, self.topic, record, reason, self.consumer)


def _write(out: IO[str], lines: list[dict[str, Any]]) -> None:
    out.write("".join(json.dumps(line) + "\n" for line in lines))
    out.flush()
    os.fsync(out.fileno())


async def _submit(
    settings: BusSettings,
    producer: AIOKafkaProducer,
    signer: Ed25519PrivateKey,
    output: Path,
    state: RunState,
    lines: list[Line],
    tally: Tally,
    out: IO[str],
) -> None:
    """Send lines [state.submitted:] in chunks; the state moves on once a chunk is acknowledged."""
    while state.submitted < len(lines):
        chunk = lines[state.submitted : state.submitted + SUBMIT_CHUNK]
        sends = []
        local: list[dict[str, Any]] = []
        for line in chunk:
            if line.custom_id in tally.answered:
                continue
            if line.submission is None or line.pool is None:
                local.append(local_error_line(state.batch_id, line))
                tally.answered.add(line.custom_id)
                tally.failed += 1
                continue
            topic = settings.names.batch_topic(line.pool)
            key = line.submission.request_id.encode()
            value = encode(line.submission)
            headers = sign_record(signer, value)
            sends.append(await producer.send(topic, value, key=key, headers=headers))
        if local:
            _write(out, local)
        await asyncio.gather(*sends)
        state.submitted += len(chunk)
        save_state(output, state)


async def _collect(
    consumer: AIOKafkaConsumer,
    output: Path,
    state: RunState,
    tally: Tally,
    out: IO[str],
    progress: Progress,
    stop: asyncio.Event,
    submitter: asyncio.Task[None],
    letters: DeadLetters,
) -> None:
    while not stop.is_set() and len(tally.answered) < state.total:
        if submitter.done() and submitter.exception() is not None:
            raise submitter.exception()  # type: ignore[misc]
        batch = await consumer.getmany(timeout_ms=300, max_records=500)
        written = []
        for records in batch.values():
            for record in records:
                try:
                    answer = decode(BatchAnswer, record.value or b"")
                except SchemaError as exc:
                    log.warning("not an answer; dead-lettered", offset=record.offset, reason=str(exc))
                    await letters.send(record, str(exc))
                    continue
                line = accept(tally, answer, state.batch_id)
                if line is not None:
                    written.append(line)
        if written:
            _write(out, written)
        if batch:
            await consumer.commit()
        progress(state, tally)
    progress(state, tally)
