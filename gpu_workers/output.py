"""Where a request's chunks go: streamed to its channel, or, for a batch request, gathered into one answer
delivered on its reply topic at the end. Either way every chunk is written to the request's replay log
(plumbing.replay) under the request's writer epoch, so another worker can take the request over."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, TypeVar

import structlog

from openai_api.batch_bodies import completed_answer
from plumbing.answers import AnswerSink
from plumbing.clients import with_backoff
from plumbing.protocol.request import END_SCRIPT, check_due, chunk_commands, end_args, still_owner
from plumbing.publisher import PipelinedPublisher
from plumbing.replay import is_terminal, log_ttl_ms
from plumbing.retry import through_outage
from queue_schemas.batch import BatchAnswer, failed_answer
from queue_schemas.codec import encode
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, TokenChunk, Usage
from queue_schemas.names import Names
from queue_schemas.usage import Timing

log = structlog.get_logger("sluice.worker")

ANSWER_ATTEMPTS = 8


class Moved(Exception):
    """The request belongs to another worker now: this one was presumed lost and the request moved."""


class RequestOutput:
    """Where a request's chunks go; a batch request's text is gathered into one answer.

    A chunk that Redis does not take is retried until `outage_s` has passed since the first failure, so
    a Redis restart pauses the stream instead of ending it (the engine's output waits meanwhile).
    """

    def __init__(
        self,
        request: InferenceRequest,
        publisher: PipelinedPublisher,
        answers: AnswerSink,
        names: Names,
        worker_id: str,
        outage_s: float,
        publish_command: str = "PUBLISH",
    ) -> None:
        self.request = request
        self._publisher = publisher
        self._answers = answers
        self._names = names
        self._worker_id = worker_id
        self._outage_s = outage_s
        self._publish_command = publish_command  # PUBLISH, or SPUBLISH on a Redis Cluster
        self._parts: list[str] = [] if request.resume is None else [request.resume.text]
        self.timing = Timing(began=time.time())  # for the request's usage event
        self.usage: Usage | None = None  # the final chunk's, once sent
        self._checked_at: float | None = None  # monotonic: the last write that read the log's moves

    async def emit(self, chunk: TokenChunk | FinalChunk | ErrorChunk) -> None:
        """Log the chunk and stream it to the client's channel; for a batch request, gather it and
        deliver the whole answer once the chunk ends the request (retried; one that cannot be delivered
        raises). Raises Moved when another worker owns the request now."""
        request = self.request
        await self.record(chunk, publish=request.batch is None)
        if request.batch is None:
            return
        answer = self.add(chunk)
        if answer is not None:
            topic = request.reply_topic
            assert topic is not None
            await with_backoff(
                lambda: self._answers.deliver(topic, request.request_id, answer),
                "delivering a batch answer",
                attempts=ANSWER_ATTEMPTS,
            )
            self.timing = replace(self.timing, ended=time.time())

    async def record(self, chunk: TokenChunk | FinalChunk | ErrorChunk, publish: bool) -> None:
        request = self.request
        terminal = is_terminal(chunk)
        ttl = log_ttl_ms(request.deadline, time.time(), terminal, request.keep_log_s)
        command = self._publish_command if publish else ""
        chunk = stamped(chunk, request.epoch)
        payload = encode(chunk)
        commands: list[tuple[str | bytes | int, ...]]
        now = time.monotonic()
        check = terminal or check_due(self._checked_at, now)
        if terminal:  # checked before it is written: a moved request's end is not this one's
            keys, args = end_args(self._names, chunk, payload, request.epoch, ttl, command)
            commands = [("EVAL", END_SCRIPT, len(keys), *keys, *args)]
        else:
            commands = chunk_commands(self._names, chunk, payload, request.epoch, ttl, command, check)
        rid = chunk.request_id

        def retrying(exc: BaseException) -> None:
            log.warning("chunk not written; retrying", request_id=rid, error=str(exc))

        async def write() -> Any:
            # A streamed request's spans end as its last chunk first leaves (not after the reply, nor at
            # a retry: the client may have it since the first try); a batch request's, once delivered.
            if terminal and publish and self.timing.ended is None:
                self.timing = replace(self.timing, ended=time.time())
            return await self._publisher.run(commands)

        reply = await through_outage(write, self._outage_s, retrying)
        if not check:
            return
        self._checked_at = now
        if not (reply == 1 if terminal else still_owner(reply, request.epoch)):
            raise Moved(chunk.request_id)

    def add(self, chunk: TokenChunk | FinalChunk | ErrorChunk) -> BatchAnswer | None:
        """The batch answer once `chunk` ends the request, else None."""
        if isinstance(chunk, ErrorChunk):
            return failed_answer(self.request, chunk.code, chunk.message)
        self._parts.append(chunk.text)
        if isinstance(chunk, FinalChunk):
            return completed_answer(self.request, "".join(self._parts), chunk.finish_reason, chunk.usage)
        return None


Chunk = TypeVar("Chunk", bound=TokenChunk | FinalChunk | ErrorChunk)


def stamped(chunk: Chunk, epoch: int) -> Chunk:
    """The chunk as its worker writes it: under the request's epoch (a worker's error chunk names its
    epoch even at 0, unlike the control plane's; see queue_schemas.messages.ErrorChunk)."""
    if chunk.epoch == epoch:
        return chunk
    return chunk.model_copy(update={"epoch": epoch})  # type: ignore[return-value]  # the same class
