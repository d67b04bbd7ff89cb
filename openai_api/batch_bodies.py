"""The OpenAI body of a batch answer the engine finished: the same body a non-streaming client gets."""

from __future__ import annotations

from openai_api.openai_types import ResponseShape
from openai_api.structured import ToolCallPlan, completion_body
from queue_schemas.batch import BatchAnswer, http_answer
from queue_schemas.messages import BatchTicket, FinishReason, InferenceRequest, Usage


def ticket_tool(ticket: BatchTicket) -> ToolCallPlan | None:
    return None if ticket.call_id is None else ToolCallPlan(ticket.call_id, ticket.function, ticket.auto)


def completed_answer(request: InferenceRequest, text: str, finish: FinishReason, usage: Usage) -> BatchAnswer:
    """The 200 answer to a batch request the engine finished: the same body a non-streaming client gets."""
    ticket = request.batch
    assert ticket is not None, "only batch requests are answered on Kafka"
    prefix = "chatcmpl" if ticket.kind == "chat" else "cmpl"
    shape = ResponseShape(
        ticket.kind,
        f"{prefix}-{request.request_id}",
        int(request.created_at),
        request.adapter or request.model,
    )
    body = completion_body(shape, text, finish, usage, ticket_tool(ticket))
    return http_answer(request.request_id, ticket.request_id, ticket.custom_id, 200, body)
