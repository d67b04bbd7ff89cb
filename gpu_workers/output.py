"""Where a request's chunks go: streamed to its channel, or, for a batch request, gathered into one answer
delivered on its reply topic at the end."""

from __future__ import annotations

from queue_schemas.answers import AnswerSink
from queue_schemas.batch import BatchAnswer, completed_answer, failed_answer
from queue_schemas.clients import with_backoff
from queue_schemas.codec import encode
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, TokenChunk
from queue_schemas.names import Names
from queue_schemas.publisher import PipelinedPublisher

ANSWER_ATTEMPTS = 8


class RequestOutput:
    """Where a request's chunks go; a batch request's text is gathered into one answer."""

    def __init__(
        self, request: InferenceRequest, publisher: PipelinedPublisher, answers: AnswerSink, names: Names
    ) -> None:
        self.request = request
        self._publisher = publisher
        self._answers = answers
        self._names = names
        self._parts: list[str] = []

    async def emit(self, chunk: TokenChunk | FinalChunk | ErrorChunk) -> None:
        """Stream the chunk to the client's channel; for a batch request, gather it and deliver the whole
        answer once the chunk ends the request (retried; one that cannot be delivered raises)."""
        request = self.request
        if request.batch is None:
            await self._publisher.publish(self._names.stream_channel(request.request_id), encode(chunk))
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

    def add(self, chunk: TokenChunk | FinalChunk | ErrorChunk) -> BatchAnswer | None:
        """The batch answer once `chunk` ends the request, else None."""
        if isinstance(chunk, ErrorChunk):
            return failed_answer(self.request, chunk.code, chunk.message)
        self._parts.append(chunk.text)
        if isinstance(chunk, FinalChunk):
            return completed_answer(self.request, "".join(self._parts), chunk.finish_reason, chunk.usage)
        return None
