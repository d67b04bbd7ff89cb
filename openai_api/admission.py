"""Admission decisions: turn a validated chat request into an InferenceRequest, or refuse it. Pure."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from openai_api.errors import InvalidRequest
from openai_api.openai_types import GenerationFields
from queue_schemas.config import PoolConfig
from queue_schemas.messages import MAX_SLO_MS, InferenceRequest, SamplingParams, StructuredOutput
from queue_schemas.prefix import block_hashes, cache_salt

B = TypeVar("B", bound=BaseModel)


def new_request_id() -> str:
    """128 random bits: request ids are unguessable, so a stream cannot be found by enumeration."""
    return secrets.token_hex(16)


def completion_tokens_allowed(body: GenerationFields, pool: PoolConfig, prompt_tokens: int) -> int:
    room = pool.context_tokens - prompt_tokens
    requested = body.requested_max_tokens()
    if requested is None:
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {pool.context_tokens} tokens. "
                f"Your messages resulted in {prompt_tokens} tokens, leaving no room for a completion.",
                param="messages",
                code="context_length_exceeded",
            )
        return min(pool.default_max_tokens, room)
    if requested > room:
        raise InvalidRequest(
            f"This model's maximum context length is {pool.context_tokens} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="messages",
            code="context_length_exceeded",
        )
    return requested


SLO_HEADERS = ("x-slo-ttft-ms", "x-slo-tpot-ms")  # llm-d's names for a request's latency objectives


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's own latency objectives, in ms (None: the pool's)."""

    ttft_ms: int | None = None
    tpot_ms: int | None = None


NO_SLO = Slo()


def slo_from_headers(headers: Mapping[str, str]) -> Slo:
    """The SLO headers of a request: whole milliseconds in 1..600,000; anything else is a 400 naming the
    header."""
    values: list[int | None] = []
    for name in SLO_HEADERS:
        raw = headers.get(name)
        if raw is None:
            values.append(None)
            continue
        text = raw.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 6) or not 0 < int(text) <= MAX_SLO_MS:
            raise InvalidRequest(
                f"The header {name} must be a whole number of milliseconds from 1 to {MAX_SLO_MS:,}.",
                param=name,
                code="invalid_slo",
            )
        values.append(int(text))
    return Slo(values[0], values[1])


def build_request(
    body: GenerationFields,
    pool: PoolConfig,
    team: str,
    prompt_token_ids: list[int],
    *,
    request_id: str,
    now: float,
    timeout_s: float,
    structured: StructuredOutput | None = None,
    key_id: str | None = None,
    keep_log_s: int = 0,
    slo: Slo = NO_SLO,
) -> InferenceRequest:
    max_tokens = completion_tokens_allowed(body, pool, len(prompt_token_ids))
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=body.stop_sequences(),
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        structured=structured,
    )
    adapter = body.model if pool.adapter(body.model) is not None else None
    salt = cache_salt(team, pool.shared_prefix_cache, adapter)
    return InferenceRequest(
        request_id=request_id,
        pool=pool.name,
        model=pool.model,
        adapter=adapter,
        team=team,
        key_id=key_id,
        prompt_token_ids=tuple(prompt_token_ids),
        block_hashes=tuple(block_hashes(prompt_token_ids, pool.block_size, salt=salt)),
        cache_salt=salt,
        sampling=sampling,
        tier=body.tier(),
        created_at=now,
        start_by=now + min(pool.queue_timeout_s, timeout_s),
        deadline=now + timeout_s,
        keep_log_s=keep_log_s,
        ttft_slo_ms=slo.ttft_ms,
        tpot_slo_ms=slo.tpot_ms,
    )


def reserved_tokens(request: InferenceRequest) -> int:
    """What admission reserves against the team's quota: the whole prompt plus every allowed output token."""
    return len(request.prompt_token_ids) + request.sampling.max_tokens


def partition_key(request: InferenceRequest) -> bytes:
    """Requests sharing a first block share a partition, so one prefix family meets one dispatcher."""
    return (request.block_hashes[0] if request.block_hashes else request.request_id).encode()


def parse_body(model: type[B], body: Any) -> B:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = most_specific(exc)
        param = ".".join(str(p) for p in err["loc"] if not is_union_tag(p)) or None
        if err["type"] == "extra_forbidden":
            raise InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param) from None
        if param in ("n", "best_of"):
            raise InvalidRequest(f"Only {param}=1 is supported.", param=param) from None
        if param == "echo":
            raise InvalidRequest("echo is not supported.", param=param) from None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None


def is_union_tag(part: int | str) -> bool:
    """pydantic puts the failed union member in `loc` ('str', 'list[str]'); clients know only the field."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "none"})


def most_specific(exc: ValidationError) -> ErrorDetails:
    """Of a union's failures, the one that is not merely 'wrong type' says what is wrong."""
    errors = exc.errors()
    return next((e for e in errors if not e["type"].endswith("_type")), errors[0])
