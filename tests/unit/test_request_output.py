"""When a worker's request counts as ended (`Timing.ended`, where its spans end): gpu_workers.output."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from redis.exceptions import ConnectionError as RedisConnectionError

from gpu_workers.output import RequestOutput
from plumbing.answers import AnswerSink
from plumbing.publisher import PipelinedPublisher
from queue_schemas.batch import BatchAnswer
from queue_schemas.messages import BatchTicket, FinalChunk, FinishReason, ReplyMode, Usage
from queue_schemas.names import Names
from tests.unit.test_codec import make_request


class FlakyRedis:
    """Loses the first write's reply (the write may have landed), then takes every write."""

    def __init__(self) -> None:
        self.tries: list[float] = []

    async def run(self, commands: list[tuple[Any, ...]]) -> Any:
        self.tries.append(time.time())
        if len(self.tries) == 1:
            await asyncio.sleep(0.01)
            raise RedisConnectionError("reply lost")
        return 1  # the end script: this worker still owns the request


class SlowAnswers:
    def __init__(self) -> None:
        self.delivered: list[float] = []

    async def deliver(self, topic: str, request_id: str, answer: BatchAnswer) -> None:
        await asyncio.sleep(0.05)
        self.delivered.append(time.time())


def final() -> FinalChunk:
    usage = Usage(prompt_tokens=3, completion_tokens=1)
    return FinalChunk(
        request_id="r" * 16, seq=0, text="x", finish_reason=FinishReason.STOP, usage=usage, worker_id="w0"
    )


def output(redis: FlakyRedis, answers: SlowAnswers, **request: object) -> RequestOutput:
    return RequestOutput(
        make_request(**request),
        cast(PipelinedPublisher, redis),
        cast(AnswerSink, answers),
        Names(),
        "w0",
        outage_s=5.0,
    )


def test_a_streamed_request_ends_at_its_last_chunks_first_try() -> None:
    redis, answers = FlakyRedis(), SlowAnswers()
    out = output(redis, answers)
    asyncio.run(out.emit(final()))
    assert len(redis.tries) == 2
    assert out.timing.ended is not None
    assert out.timing.ended <= redis.tries[0]  # the client may have had it since then


def test_a_batch_request_ends_when_its_answer_is_delivered() -> None:
    redis, answers = FlakyRedis(), SlowAnswers()
    ticket = BatchTicket(request_id="line-1")
    out = output(redis, answers, reply=ReplyMode.KAFKA, reply_topic="answers", batch=ticket)
    asyncio.run(out.emit(final()))
    assert len(answers.delivered) == 1
    assert out.timing.ended is not None
    assert out.timing.ended >= answers.delivered[0]
