"""The OpenAI streaming contract, chunk by chunk, with the official client (sync and async)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from gpu_workers.simulated import reply_text
from infra.devstack import Endpoints
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, InferenceRequest, SamplingParams, TokenChunk
from tests.e2e.conftest import day_used, openai_client, placed_on, running_on, team_key, terminal_log
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is a queue?"}]


def sim_reply(prompt_ids: list[int], max_tokens: int) -> str:
    req = InferenceRequest(
        request_id="x" * 16, pool="sim", model="m", team="t", prompt_token_ids=tuple(prompt_ids),
        sampling=SamplingParams(max_tokens=max_tokens), created_at=0, deadline=1,
    )  # fmt: skip
    return reply_text(req)[:max_tokens]


def chat_prompt_ids(messages: list[ChatCompletionMessageParam]) -> list[int]:
    return ByteTokenizer().encode_chat([ChatMessage.model_validate(m) for m in messages])


def sync_client(endpoints: Endpoints, **kw: Any) -> openai.OpenAI:
    return openai_client(endpoints, **kw)


def test_chunk_sequence_field_by_field(endpoints: Endpoints) -> None:
    prompt = chat_prompt_ids(MESSAGES)
    expected = sim_reply(prompt, 30)
    raw = sync_client(endpoints, max_retries=0).chat.completions.with_raw_response.create(
        model="sluice-sim",
        messages=MESSAGES,
        stream=True,
        max_tokens=30,
        stream_options={"include_usage": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    first, *middle, finish, usage = chunks
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    assert ids.pop().startswith("chatcmpl-")
    assert len({c.created for c in chunks}) == 1
    assert {c.model for c in chunks} == {"sluice-sim"}
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    # The role comes once, in the first delta, with empty content.
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in [*middle, finish])
    # Content deltas, then a finish chunk with an empty delta, then the usage chunk.
    assert "".join(c.choices[0].delta.content or "" for c in middle) == expected
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert finish.choices[0].finish_reason == "length"
    assert finish.choices[0].delta.content is None
    assert usage.choices == []
    assert usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(prompt), 30)
    assert usage.usage.total_tokens == len(prompt) + 30
    assert all(c.usage is None for c in chunks[:-1])


def test_without_include_usage_no_usage_field_is_sent(endpoints: Endpoints) -> None:
    r = httpx.post(
        endpoints.url + "/v1/chat/completions",
        json={"model": "sluice-sim", "messages": MESSAGES, "stream": True, "max_tokens": 5},
        headers={"Authorization": f"Bearer {endpoints.api_key}"},
    )
    payloads = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in json.loads(p) for p in payloads[:-1])


def test_async_client_streamed_and_not(endpoints: Endpoints) -> None:
    prompt = chat_prompt_ids(MESSAGES)

    async def go() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=endpoints.url + "/v1", api_key=endpoints.api_key, max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="sluice-sim", messages=MESSAGES, stream=True, max_tokens=20
            )
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            done = await client.chat.completions.create(model="sluice-sim", messages=MESSAGES, max_tokens=20)
            return streamed, done.choices[0].message.content or ""
        finally:
            await client.close()

    streamed, whole = asyncio.run(go())
    assert streamed == whole == sim_reply(prompt, 20)


def test_text_completions_streamed_and_not(endpoints: Endpoints) -> None:
    client = sync_client(endpoints, max_retries=0)
    prompt = "Once upon a time"
    expected = sim_reply(list(prompt.encode()), 12)
    done = client.completions.create(model="sluice-sim", prompt=prompt, max_tokens=12)
    assert done.object == "text_completion"
    assert done.id.startswith("cmpl-")
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(prompt.encode())
    chunks = list(client.completions.create(model="sluice-sim", prompt=[prompt], max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    default = client.completions.create(model="sluice-sim", prompt=prompt)
    assert default.usage is not None
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ],
)
def test_unsupported_completion_fields_are_named(
    endpoints: Endpoints, body: dict[str, object], param: str
) -> None:
    r = httpx.post(
        endpoints.url + "/v1/completions",
        json={"model": "sluice-sim", **body},
        headers={"Authorization": f"Bearer {endpoints.api_key}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_error_mid_stream_is_an_error_payload(endpoints: Endpoints) -> None:
    stream = sync_client(endpoints, max_retries=0).chat.completions.create(
        model="sluice-flaky", messages=MESSAGES, stream=True, max_tokens=50
    )
    received: list[str] = []

    def drain() -> None:
        received.extend(chunk.choices[0].delta.content or "" for chunk in stream)

    with pytest.raises(openai.APIError, match="simulated engine fault"):
        drain()
    assert len("".join(received)) == 5, "the tokens before the fault were delivered"


def test_keep_alive_comments_while_queued(endpoints: Endpoints) -> None:
    lines = []
    with httpx.stream(
        "POST",
        endpoints.url + "/v1/chat/completions",
        json={"model": "sluice-slow", "messages": MESSAGES, "stream": True, "max_tokens": 2},
        headers={"Authorization": f"Bearer {endpoints.api_key}"},
        timeout=30,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    first_content = next(
        i for i, line in enumerate(lines) if '"content":"' in line and '"content":""' not in line
    )
    assert any(line.startswith(":") for line in lines[:first_content]), lines[:first_content]
    assert lines[-1] == "data: [DONE]"


def test_disconnect_aborts_the_engine_and_charges_only_what_was_generated(endpoints: Endpoints) -> None:
    key = team_key(endpoints, "disconnect")
    client = openai_client(endpoints, key)
    prompt = chat_prompt_ids(MESSAGES)
    stream = client.chat.completions.create(
        model="sluice-slow", messages=MESSAGES, stream=True, max_tokens=200
    )
    got, request_id = "", ""
    for chunk in stream:
        request_id = chunk.id.removeprefix("chatcmpl-")
        got += chunk.choices[0].delta.content or ""
        if len(got) >= 3:
            break
    stream.close()
    # The worker settles the quota, then logs the terminal chunk: once that is there, both are done.
    log = until(lambda: terminal_log(endpoints, request_id), 20, "the request's terminal chunk")
    end = log[-1]
    assert isinstance(end, ErrorChunk), end
    assert end.code == ErrorCode.CANCELLED
    generated = sum(e.num_tokens for e in log if isinstance(e, TokenChunk))
    # Stopped, not run to its 200 tokens (8 s at 40 ms each), and charged exactly what it generated.
    assert len(got) <= generated < 200
    assert day_used(endpoints, "disconnect") == len(prompt) + generated
    # The worker that served it (the scaler may have replaced the pool's first worker by now).
    worker = placed_on(endpoints, request_id)
    until(lambda: running_on(endpoints, "slow", worker) == 0, 10, "the engine reported idle")


def test_prompt_tokens_come_from_the_pool_tokenizer(endpoints: Endpoints, tiny_tokenizer: object) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer), local_files_only=True)
    conversation = [{"role": str(m["role"]), "content": str(m.get("content"))} for m in MESSAGES]
    expected = tok.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    done = sync_client(endpoints, max_retries=0).chat.completions.create(
        model="sluice-tok", messages=MESSAGES, max_tokens=3
    )
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(expected)
    assert len(expected) != len(chat_prompt_ids(MESSAGES)), "the BPE count must differ from the byte count"
