"""The input boundary: what it refuses, where it says the problem is, and (generated, hostile JSON) that a
body it passed goes through the request models and encodes, for each entry: an HTTP body, a Kafka batch
record, a line of an uploaded file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dispatcher.batch_intake import batch_request, parse_batch_body, plan_batch_output
from ingress.batches.api import MAX_LINE_BYTES, parse_line, read_input
from openai_api.admission import build_request, parse_body
from openai_api.errors import ApiError
from openai_api.openai_types import ChatCompletionRequest, CompletionRequest
from queue_schemas.batch import BatchSubmission, failed_answer, http_answer, load_record, parse_submission
from queue_schemas.boundary import INT64_MAX, MAX_DEPTH, InputLimits, InputRefused, load_untrusted
from queue_schemas.codec import encode
from queue_schemas.config import load_config

pytestmark = pytest.mark.unit

POOL = load_config(Path(__file__).parents[2] / "queue_schemas" / "default_pools.toml").pool("sim")


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b'{"stop": ["\\ud800"]}', "stop.0", "lone surrogate"),
        (b'{"m": [{"\\udfff": 1}]}', "m.0", "lone surrogate"),
        (b'{"temperature": NaN}', None, "NaN"),
        (b'{"temperature": -Infinity}', None, "-Infinity"),
        (b'{"temperature": 1e999}', "temperature", "finite"),
        (b'{"seed": 9223372036854775808}', "seed", "64-bit"),
        (b'{"seed": -9223372036854775809}', "seed", "64-bit"),
    ],
)
def test_what_the_services_cannot_carry_is_refused_by_name(raw: bytes, param: str | None, words: str) -> None:
    with pytest.raises(InputRefused) as refused:
        load_untrusted(raw)
    assert refused.value.param == param
    assert words in refused.value.message
    refused.value.message.encode()  # the message itself carries no surrogate back


def test_depth_and_size_limits() -> None:
    assert load_untrusted(json.dumps(nested(MAX_DEPTH - 1))) == nested(MAX_DEPTH - 1)
    with pytest.raises(InputRefused, match=f"deeper than {MAX_DEPTH}"):
        load_untrusted(json.dumps(nested(MAX_DEPTH + 1)))
    with pytest.raises(InputRefused, match="deeper"):
        load_untrusted(b"[" * 100_000 + b"]" * 100_000)  # past the parser's own recursion
    with pytest.raises(InputRefused, match="longer than 10") as refused:
        load_untrusted(b'{"a": {"b": "' + b"x" * 11 + b'"}}', InputLimits(max_string_chars=10))
    assert refused.value.param == "a.b"
    assert load_untrusted(f'{{"seed": {INT64_MAX}}}') == {"seed": INT64_MAX}
    assert load_untrusted('{"s": "\\ud83d\\ude00"}') == {"s": "\U0001f600"}  # a pair is one character


def test_a_file_line_over_the_limit_is_refused_by_number() -> None:
    ok = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}})
    big = json.dumps(
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x" * MAX_LINE_BYTES},
        }
    )
    assert (
        read_input(f"{ok}\n{big}\n".encode())
        == f"Line 2: longer than the {MAX_LINE_BYTES}-byte limit of a line"
    )
    poisoned = ok.replace('"a"', '"\\ud800"')
    found = read_input(f"{ok}\n{poisoned}\n".encode())
    assert isinstance(found, str)
    assert found.startswith("Line 2: custom_id: ")
    assert "lone surrogate" in found


# Hostile JSON: lone surrogates, non-finite and huge numbers, deep nesting, odd types where values go.
SURROGATES = st.sampled_from(["\ud800", "a\udfff", "\udbff\ud800x", "ok"])
TEXT = st.one_of(st.text(alphabet=st.characters(exclude_categories=()), max_size=12), SURROGATES)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True)
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.one_of(
    st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
        max_leaves=12,
    ),
    st.integers(min_value=MAX_DEPTH - 2, max_value=300).map(nested),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.one_of(TEXT, VALUES)}
)
CHAT = st.fixed_dictionaries(
    {"model": st.just("sluice-sim"), "messages": st.lists(MESSAGE, min_size=1, max_size=2)},
    optional={
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), VALUES),
        "max_tokens": NUMBERS,
        "temperature": NUMBERS,
        "seed": NUMBERS,
        "user": TEXT,
        "metadata": VALUES,
        "response_format": st.one_of(
            VALUES,
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": VALUES}),
                }
            ),
        ),
        "logit_bias": VALUES,
        "tools": VALUES,
    },
)
TEXT_BODY = st.fixed_dictionaries(
    {"model": st.just("sluice-sim"), "prompt": st.one_of(TEXT, VALUES)},
    optional={"stop": st.one_of(TEXT, VALUES), "max_tokens": NUMBERS, "seed": NUMBERS},
)


def wire(value: Any) -> bytes:
    """As a client would send it: JSON with surrogates escaped and non-finite numbers spelled out."""
    return json.dumps(value, allow_nan=True).encode()


HYPOTHESIS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def http_outcome(body: dict[str, Any]) -> str:
    """What ingress does with `body`: "refused" (a 4xx naming the field) or "encoded" (it reached the bus);
    anything raised here would be a 500 or a dead service."""
    try:
        raw = load_untrusted(wire(body))
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        parsed = parse_body(model, raw)
        request = build_request(
            parsed, POOL, "acme", [1, 2, 3], request_id="chatcmpl-test-0001", now=0.0, timeout_s=60.0
        )
    except (InputRefused, ApiError):
        return "refused"
    encode(request)
    return "encoded"


def record_outcome(body: dict[str, Any], custom_id: str, request_id: str) -> str:
    """What BatchDesk.admit does with a batch record: "dead-lettered", "answered" (an error answer) or
    "encoded" (held for placement)."""
    url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    record = {
        "v": 1,
        "request_id": request_id,
        "custom_id": custom_id,
        "team": "acme",
        "url": url,
        "body": body,
    }
    obj = load_record(wire(record))
    if isinstance(obj, str):
        return "dead-lettered"
    sub = parse_submission(obj)
    if isinstance(sub, str):
        return "dead-lettered"
    try:  # as BatchDesk.admit: a request the pool cannot serve is answered with the error
        parsed = plan_batch_output(sub, parse_batch_body(sub, POOL), None)
        request = batch_request(sub, "sluice.results.acme", POOL, parsed, [1, 2, 3], 0.0)
    except ApiError as err:
        encode(http_answer("k", sub.request_id, sub.custom_id, err.status, err.body()))
        return "answered"
    encode(request)
    encode(failed_answer(request, "bad_request", "x"))
    return "encoded"


GOOD_CHAT = {"model": "sluice-sim", "messages": [{"role": "user", "content": "hi"}], "stop": ["\n"]}
HOSTILE_CHAT = {"model": "sluice-sim", "messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}


def test_the_outcomes_reach_both_ends() -> None:
    """The properties below are only as strong as these: a good body is carried, a hostile one refused."""
    assert http_outcome(GOOD_CHAT) == "encoded"
    assert http_outcome(HOSTILE_CHAT) == "refused"
    assert record_outcome(GOOD_CHAT, "c-1", "r-1") == "encoded"
    assert record_outcome(HOSTILE_CHAT, "c-1", "r-1") == "dead-lettered"
    assert record_outcome({**GOOD_CHAT, "max_tokens": 10**6}, "c-1", "r-1") == "answered"


@HYPOTHESIS
@given(body=st.one_of(CHAT, TEXT_BODY))
@example(body=GOOD_CHAT)
def test_an_http_body_that_passed_the_boundary_always_encodes(body: dict[str, Any]) -> None:
    event(http_outcome(body))


@HYPOTHESIS
@given(body=st.one_of(CHAT, TEXT_BODY), custom_id=TEXT, request_id=TEXT)
@example(body=GOOD_CHAT, custom_id="c-1", request_id="r-1")
def test_a_batch_record_that_passed_the_boundary_always_encodes(
    body: dict[str, Any], custom_id: str, request_id: str
) -> None:
    event(record_outcome(body, custom_id, request_id))


@HYPOTHESIS
@given(body=st.one_of(CHAT, TEXT_BODY, VALUES), custom_id=st.one_of(TEXT, VALUES))
def test_a_file_line_that_passed_the_checks_always_encodes_as_a_submission(body: Any, custom_id: Any) -> None:
    row = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    line = parse_line(wire(row), 0, set())
    if isinstance(line, str):
        return
    submission = BatchSubmission(
        request_id="acme:batch_1:0", custom_id=line.custom_id, team="acme",
        reply_topic="sluice.batch-answers", url=line.url,  # type: ignore[arg-type]
        body=line.body, completion_window_s=60.0, submitted_at=0.0,
    )  # fmt: skip
    submission.model_dump_json(exclude_none=True).encode()


def test_a_refusal_stays_small_whatever_the_body_held() -> None:
    body: dict[str, Any] = {"v": "\ud800"}
    for depth in range(20):
        body = {f"{depth}" + "k" * 100_000: body}
    with pytest.raises(InputRefused) as refused:
        load_untrusted(wire(body))
    assert refused.value.param is not None
    assert len(refused.value.param) <= 515
    assert len(refused.value.message) <= 1024
    assert refused.value.param.startswith("19" + "k" * 62 + "...")
