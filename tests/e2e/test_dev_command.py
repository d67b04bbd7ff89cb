"""`sluice dev` as a user runs it: SmolLM2 on real vLLM beside the simulated pool, a printed curl that
works, real answers through the official client, and Ctrl-C leaving no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import redis.asyncio as aioredis
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel, Field, SecretStr

from gpu_workers.kv_publisher import KvMirror
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import HFTokenizer
from queue_schemas.codec import decode
from queue_schemas.messages import KvEvent
from queue_schemas.names import Names
from queue_schemas.prefix import block_hashes, cache_salt
from tests.e2e.dev_cli import DevRun, pid_alive, processes_with_env, sluice_dev

MODEL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def dev_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevRun]:
    """`sluice dev` with its defaults; SmolLM2 is prepared in the repository's cache."""
    models = Path(__file__).parents[2] / ".sluice" / "models"
    with sluice_dev(tmp_path_factory.mktemp("dev"), "--models-dir", str(models)) as run:
        yield run


def test_the_stack_runs_every_service(dev_run: DevRun) -> None:
    wanted = {"broker", "redis", "ingress", "scaler"}
    wanted |= {f"dispatcher-{pool}{n}" for pool in ("smollm2", "sim") for n in ("", "-2")}
    assert wanted <= set(dev_run.pids)
    assert dev_run.env["SLUICE_API_KEY"].startswith("sk-sluice-")
    # ingress, two dispatchers per pool, the scaler and the two workers it started (vLLM's own beside)
    assert len(processes_with_env("SLUICE_REDIS_URL", dev_run.env["SLUICE_REDIS_URL"])) >= 8


def test_the_printed_curl_streams_from_smollm2(dev_run: DevRun) -> None:
    assert '"model": "smollm2-135m-instruct"' in dev_run.curl_line
    out = subprocess.run(
        shlex.split(dev_run.curl_line), capture_output=True, text=True, timeout=120, check=True
    ).stdout
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert len(events) > 3
    assert events[-1] == "[DONE]"
    assert '"role":"assistant"' in events[0]


def _client(dev_run: DevRun) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=dev_run.env["SLUICE_URL"] + "/v1", api_key=dev_run.env["SLUICE_API_KEY"], max_retries=0
    )


def test_smollm2_answers_through_the_official_client(dev_run: DevRun) -> None:
    question: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    with _client(dev_run) as client:
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=question,
            max_tokens=30,
            temperature=0,
        )
        stream = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=question,
            max_tokens=30,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert streamed == reply.choices[0].message.content, "greedy: streamed and whole answers agree"
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0


def test_a_long_prompt_twice_is_cached_and_indexed(dev_run: DevRun) -> None:
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": text},
        {"role": "user", "content": "How many boxes?"},
    ]
    usages = []
    with _client(dev_run) as client:
        for _ in range(2):
            reply = client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=messages,
                max_tokens=4,
                temperature=0,
            )
            assert reply.usage is not None
            usages.append(reply.usage)
    prompt_tokens = usages[0].prompt_tokens
    assert prompt_tokens > 2 * 128
    cached = [(u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0 for u in usages]
    assert cached[0] == 0
    # Every full block but the one holding the last prompt token (the engine computes that one again).
    assert cached[1] == ((prompt_tokens - 1) // 128) * 128

    folder = Path(__file__).parents[2] / ".sluice" / "models" / "smollm2-135m-instruct"
    tok = HFTokenizer(folder)
    ids = tok.encode_chat([ChatMessage.model_validate(dict(m)) for m in messages])
    assert len(ids) == prompt_tokens, "ingress counted the prompt as the engine saw it"
    indexed = asyncio.run(_indexed_blocks(dev_run.env["SLUICE_REDIS_URL"], "smollm2-w0"))
    # Named by the salted chain of the key's team, as ingress named them for placement.
    ours = block_hashes(ids, 128, salt=cache_salt("dev", shared=False))
    assert set(ours) <= indexed, "the worker's prefix index holds the prompt's blocks"


async def _indexed_blocks(redis_url: str, worker_id: str) -> set[str]:
    """Blocks the worker's KV event stream says it holds, replayed from the start."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        mirror = KvMirror()
        for _, fields in await redis.xrange(Names().kv_index(worker_id), "-", "+") or []:
            assert fields is not None
            event = decode(KvEvent, fields[b"m"])
            mirror.apply(event.kind, event.block_hashes)
        return mirror.blocks
    finally:
        await redis.aclose()


def test_a_prompt_over_the_context_is_refused(dev_run: DevRun) -> None:
    with _client(dev_run) as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "word " * 3000}],
        )
    assert err.value.code == "context_length_exceeded"


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def test_smollm2_follows_a_json_schema(dev_run: DevRun) -> None:
    ask: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Describe a programmer called Ada, 36 years old, as JSON."}
    ]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with _client(dev_run) as client:
        whole = client.chat.completions.create(
            model=MODEL, messages=ask, response_format=fmt, max_tokens=120, temperature=0
        )
        stream = client.chat.completions.create(
            model=MODEL, messages=ask, response_format=fmt, max_tokens=120, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), PERSON)
    jsonschema.validate(json.loads(streamed), PERSON)


def test_smollm2_calls_a_named_tool_as_streamed_deltas(dev_run: DevRun) -> None:
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    ]
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    with (
        _client(dev_run) as client,
        client.chat.completions.stream(
            model=MODEL, messages=ask, tools=tools, tool_choice=choice, max_tokens=60, temperature=0
        ) as stream,
    ):
        final = stream.get_final_completion()
    call: Any = (final.choices[0].message.tool_calls or [])[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_smollm2_with_auto_tool_choice_gives_text_or_a_schema_valid_call_whichever_it_picks(
    dev_run: DevRun,
) -> None:
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    ]
    with _client(dev_run) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=ask, tools=tools, max_tokens=80, temperature=0
        )
    choice = reply.choices[0]
    if choice.message.tool_calls:
        call: Any = choice.message.tool_calls[0]
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    else:
        assert choice.finish_reason == "stop"
        assert choice.message.content


def test_a_schema_the_engine_cannot_compile_is_refused_before_queueing(dev_run: DevRun) -> None:
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}  # valid JSON Schema
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": dangling}}
    with _client(dev_run) as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=fmt
        )
    body: Any = err.value.body
    assert body["param"] == "response_format.json_schema.schema"
    assert "cannot compile" in body["message"]


class City(BaseModel):
    """A city and the country it is in."""

    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


def test_langchain_gets_a_structured_output(dev_run: DevRun) -> None:
    llm = ChatOpenAI(
        model=MODEL,
        base_url=dev_run.env["SLUICE_URL"] + "/v1",
        api_key=SecretStr(dev_run.env["SLUICE_API_KEY"]),
        temperature=0,
        max_completion_tokens=60,
        max_retries=0,
    )
    answer = llm.with_structured_output(City, method="json_schema").invoke(
        "Which city is the capital of France?"
    )
    assert isinstance(answer, City)
    assert answer.city


def test_a_batch_file_through_kafka_with_the_dev_env(dev_run: DevRun, tmp_path: Path) -> None:
    """The README's batch recipe: dev.env, then `sluice batch submit`; SmolLM2 on vLLM and the sim pool."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = {"max_tokens": 24, "temperature": 0}
    rows = [
        {"custom_id": "france", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "smollm2-135m-instruct", "messages": question, **greedy}},
        {"custom_id": "sim", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "sluice-sim", "messages": question}},
        {"custom_id": "unknown-model", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-nothing", "messages": question}},
    ]  # fmt: skip
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {**os.environ, **dev_run.env}
    argv = [sys.executable, "-m", "infra.cli", "batch", "submit", str(source), "--team", "dev"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {row["custom_id"]: row for row in map(json.loads, (tmp_path / "requests.output.jsonl").open())}
    assert set(lines) == {"france", "sim", "unknown-model"}
    answer = lines["france"]["response"]["body"]["choices"][0]["message"]["content"]
    assert "Paris" in answer
    assert lines["sim"]["response"]["status_code"] == 200
    assert lines["unknown-model"]["error"]["code"] == "invalid_line"


def test_ctrl_c_stops_everything(dev_run: DevRun) -> None:
    """The module's last test: Ctrl-C on the very `sluice dev` the others used (SmolLM2 on vLLM beside
    the simulated pool). Run alone, it starts one of its own."""
    assert dev_run.proc.poll() is None, "the dev stack was up before Ctrl-C"
    up = processes_with_env("SLUICE_REDIS_URL", dev_run.env["SLUICE_REDIS_URL"])
    workers = [pid for pid in up if pid not in dev_run.pids.values()]
    dev_run.proc.send_signal(signal.SIGINT)
    code = dev_run.proc.wait(timeout=60)
    assert code == 0, dev_run.stderr_path.read_text()
    assert len(up) >= 8, "ingress, the scaler, two dispatchers per pool and the workers were up"
    assert len(workers) >= 2, "the scaler had started the two pools' workers (vLLM's engine beside)"
    survivors = {name: pid for name, pid in dev_run.pids.items() if pid_alive(pid)}
    assert survivors == {}
    leftover = processes_with_env("SLUICE_REDIS_URL", dev_run.env["SLUICE_REDIS_URL"])
    assert leftover == [], "a worker started by the scaler (or its engine) survived"
