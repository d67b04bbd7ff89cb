"""The official openai client against the running ingress, through the real broker and Redis."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from aiokafka import AIOKafkaProducer
from openai.types.chat import ChatCompletionMessageParam

from gpu_workers.simulated import reply_text
from infra.devstack import Endpoints
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.config import load_config
from queue_schemas.messages import DeadLetter, InferenceRequest, SamplingParams
from queue_schemas.names import Names
from tests.conftest import read_dead_letters
from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.timeout(90)

MODEL = "sluice-sim"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about queues."},
]


def client(endpoints: Endpoints, key: str | None = None) -> openai.OpenAI:
    return openai_client(endpoints, key)


def expected_reply(max_tokens: int) -> tuple[str, int]:
    """What the simulated engine answers to MESSAGES, and the exact prompt length in tokens."""
    prompt = ByteTokenizer().encode_chat([ChatMessage.model_validate(m) for m in MESSAGES])
    req = InferenceRequest(
        request_id="x" * 16, pool="sim", model=MODEL, team="t", prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens), created_at=0, deadline=1,
    )  # fmt: skip
    return reply_text(req)[:max_tokens], len(prompt)


def test_streamed_completion(endpoints: Endpoints) -> None:
    stream = client(endpoints).chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=40, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text, prompt_tokens = expected_reply(40)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert {c.model for c in chunks} == {MODEL}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (prompt_tokens, 40)
    assert all(c.usage is None for c in chunks[:-1])


def test_non_streamed_completion(endpoints: Endpoints) -> None:
    done = client(endpoints).chat.completions.create(model=MODEL, messages=MESSAGES)
    full, prompt_tokens = expected_reply(10_000)
    default_max = load_config(None).pool("sim").default_max_tokens
    text = full[:default_max]
    assert done.choices[0].message.content == text
    assert done.choices[0].finish_reason == ("length" if len(full) > default_max else "stop")
    assert done.usage is not None
    assert done.usage.prompt_tokens == prompt_tokens
    assert done.usage.completion_tokens == len(text)


def test_stop_sequence_ends_the_completion(endpoints: Endpoints) -> None:
    text, _ = expected_reply(10_000)
    stop = text.split()[3]
    done = client(endpoints).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stop=stop,
        max_tokens=1000,
    )
    assert done.choices[0].message.content == text[: text.find(stop)]
    assert done.choices[0].finish_reason == "stop"


def test_models_lists_the_pool_models(endpoints: Endpoints) -> None:
    models = {m.id for m in client(endpoints).models.list()}
    pools = ("slow", "flaky", "empty", "shared", "private", "tok")
    assert models == {MODEL, *(f"sluice-{pool}" for pool in pools)}


def test_missing_or_wrong_key_is_401(endpoints: Endpoints) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        client(endpoints, key="sk-sluice-wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
    assert err.value.code == "invalid_api_key"
    r = httpx.post(endpoints.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "missing_api_key"


def test_unknown_model_is_404(endpoints: Endpoints) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client(endpoints).chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    assert err.value.param == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": MESSAGES, "temperature": 7}, "temperature"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": MESSAGES, "n": 2}, "n"),
        ({"model": MODEL, "messages": MESSAGES, "logprobs": True}, "logprobs"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 100_000}, "messages"),
        ({"messages": MESSAGES}, "model"),
        ({"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(
    endpoints: Endpoints, body: dict[str, object], param: str
) -> None:
    r = httpx.post(
        endpoints.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {endpoints.api_key}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff"])
def test_malformed_json_is_400(endpoints: Endpoints, raw: bytes) -> None:
    r = httpx.post(
        endpoints.url + "/v1/chat/completions",
        content=raw,
        headers={"Authorization": f"Bearer {endpoints.api_key}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_path_and_method_get_openai_errors(endpoints: Endpoints) -> None:
    assert httpx.get(endpoints.url + "/v1/nope").json()["error"]["code"] == "unknown_url"
    r = httpx.get(endpoints.url + "/v1/chat/completions")
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_poison_on_the_topic_does_not_stop_the_dispatcher(endpoints: Endpoints) -> None:
    names = Names()

    async def poison_then_read_deadletters() -> list[DeadLetter]:
        producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap)
        await producer.start()
        try:
            for partition in range(4):
                await producer.send_and_wait(names.requests_topic("sim"), b"\x00poison", partition=partition)
        finally:
            await producer.stop()
        # Every partition now starts with poison: a completion after it proves the dispatcher went on.
        done = client(endpoints).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
        assert done.choices[0].finish_reason == "length"

        def poisoned(letter: DeadLetter) -> bool:
            return letter.payload.endswith("poison")

        return await read_dead_letters(endpoints.kafka_bootstrap, names, at_least=4, wanted=poisoned)

    poisoned = asyncio.run(poison_then_read_deadletters())
    assert len(poisoned) == 4
    assert all("not valid JSON" in letter.reason for letter in poisoned)


def test_metrics_are_exported(endpoints: Endpoints) -> None:
    client(endpoints).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert (
        'sluice_ingress_requests_total{outcome="ok",pool="sim"}' in httpx.get(endpoints.url + "/metrics").text
    )
    assert 'sluice_pool_lag{pool="sim"}' in httpx.get(endpoints.scaler_url + "/metrics").text
