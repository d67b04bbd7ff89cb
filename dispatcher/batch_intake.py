"""Batch submissions to inference requests: the checks ingress makes on HTTP bodies, applied to Kafka.

Pure apart from tokenizing. A refused submission raises the same ApiError an HTTP client would get; the
dispatcher sends it back as the answer's response (status and OpenAI error body).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Literal

from openai_api.admission import build_request, parse_body
from openai_api.errors import InvalidRequest, NotFound
from openai_api.openai_types import ChatCompletionRequest, CompletionRequest, GenerationFields
from openai_api.structured import (
    CompileCheck,
    OutputPlan,
    check_sizes,
    plan_output,
    tool_definitions,
)
from openai_api.tokenizer import PromptTokenizer, encode_off_loop
from queue_schemas.batch import DEFAULT_COMPLETION_WINDOW_S, BatchSubmission, internal_request_id
from queue_schemas.config import PoolConfig
from queue_schemas.messages import BatchTicket, InferenceRequest, Priority, ReplyMode, Tier

RUN_ALLOWANCE_S = 3600.0  # once started, how long a batch request may run before it is abandoned


@dataclass(frozen=True, slots=True)
class BatchBody:
    body: GenerationFields
    kind: Literal["chat", "text"]
    plan: OutputPlan = field(default_factory=OutputPlan)  # set by `plan_batch_output`, the costly check


def call_id_for(request_id: str) -> str:
    """A tool call id that is the same on every delivery of the submission."""
    return "call_" + hashlib.sha256(request_id.encode()).hexdigest()[:24]


def parse_batch_body(sub: BatchSubmission, pool: PoolConfig) -> BatchBody:
    """Validate the submission's OpenAI body for `pool` (whose batch topic it came from): the cheap
    checks, schema sizes included; `plan_batch_output` makes the expensive ones."""
    body: GenerationFields
    kind: Literal["chat", "text"]
    if sub.url == "/v1/chat/completions":
        chat = parse_body(ChatCompletionRequest, sub.body)
        check_sizes(chat)
        body, kind = chat, "chat"
    else:
        body, kind = parse_body(CompletionRequest, sub.body), "text"
    if body.stream:
        raise InvalidRequest("stream is not supported in a batch; the answer comes whole.", param="stream")
    if body.model != pool.model and pool.adapter(body.model) is None:
        raise NotFound(
            f"The model '{body.model}' is not served by pool '{pool.name}', whose batch topic this is.",
            param="model",
            code="model_not_found",
        )
    return BatchBody(body, kind)


def plan_batch_output(
    sub: BatchSubmission, parsed: BatchBody, compile_check: CompileCheck | None
) -> BatchBody:
    """The body with its output plan: schemas validated and compiled (run it in a check thread)."""
    if not isinstance(parsed.body, ChatCompletionRequest):
        return parsed
    rid = internal_request_id(sub.team, sub.request_id)
    plan = plan_output(parsed.body, call_id_for(rid), compile_check, tool_parser=False)
    return replace(parsed, plan=plan)


async def prompt_ids(sub: BatchSubmission, parsed: BatchBody, tokenizer: PromptTokenizer) -> list[int]:
    """The submitter's token ids if it sent them (checked against the vocabulary), else the prompt
    tokenized with the pool's tokenizer and chat template, as ingress does."""
    if sub.prompt_token_ids is not None:
        vocab = tokenizer.vocab_size
        bad = next((t for t in sub.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt_token_ids holds {bad}, outside the pool tokenizer's vocabulary of {vocab}.",
                param="prompt_token_ids",
            )
        return list(sub.prompt_token_ids)
    size = len(str(sub.body))
    if isinstance(parsed.body, ChatCompletionRequest):
        chat = parsed.body
        ids = await encode_off_loop(
            lambda m: tokenizer.encode_chat(m, tool_definitions(chat)), chat.messages, size
        )
    else:
        assert isinstance(parsed.body, CompletionRequest)
        ids = await encode_off_loop(tokenizer.encode_text, parsed.body.prompt_text(), size)
    if not ids:
        raise InvalidRequest("The prompt is empty.", param="prompt")
    return ids


def batch_request(
    sub: BatchSubmission, reply_topic: str, pool: PoolConfig, parsed: BatchBody, ids: list[int], now: float
) -> InferenceRequest:
    """The bus request: batch priority, answered on `reply_topic`, waiting up to its completion window."""
    window = sub.completion_window_s or DEFAULT_COMPLETION_WINDOW_S
    rid = internal_request_id(sub.team, sub.request_id)
    request = build_request(
        parsed.body, pool, sub.team, ids, request_id=rid, now=now, timeout_s=window + RUN_ALLOWANCE_S,
        structured=parsed.plan.structured,
    )  # fmt: skip
    tool = parsed.plan.tool
    ticket = BatchTicket(
        request_id=sub.request_id,
        custom_id=sub.custom_id,
        kind=parsed.kind,
        call_id=None if tool is None else tool.call_id,
        function=None if tool is None else tool.name,
        auto=False if tool is None else tool.auto,
    )
    return request.model_copy(
        update={
            "priority": Priority.BATCH,
            "tier": Tier.DEFAULT,  # a batch line's service_tier has no say: batch is the last band
            "reply": ReplyMode.KAFKA,
            "reply_topic": reply_topic,
            "batch": ticket,
            "start_by": now + window,
        }
    )
