"""Chaos on real vLLM: a SmolLM2 worker killed (-9) while it streams greedy answers. Its streams go on
from the other worker, and each answer, as the official client reads it, is the very answer an
uninterrupted run gives, with the same usage."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis
from openai import OpenAI

from infra.devstack import DevStack, Endpoints
from infra.launcher import child_pids
from infra.models import prepare_smollm2
from queue_schemas.settings import BusSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODELS = Path(__file__).parents[2] / ".sluice" / "models"
POOLS = """
[[pools]]
name = "smollm2"
model = "smollm2-135m-instruct"
engine = "vllm"
context_tokens = 2048
block_size = 128
queue_timeout_s = 300

[pools.vllm]
source = "{source}"
kv_cache_gib = 0.5
max_num_seqs = 8

[pools.scaling]
min_replicas = 2
max_replicas = 2
startup_s = 60
"""
PROMPTS = [
    "Describe the sea in three sentences.",
    "List four things a good kitchen has.",
    "Explain what a queue is to a child.",
    "Write a short note about autumn.",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Endpoints]]:
    workdir = tmp_path_factory.mktemp("chaos-vllm")
    source = prepare_smollm2(MODELS / "smollm2-135m-instruct", MODELS / "downloads")
    config = workdir / "pools.toml"
    config.write_text(POOLS.format(source=source.resolve()))
    dev = DevStack(workdir, config_path=config, workers_ready_s=600)
    try:
        yield dev, dev.start()
    finally:
        dev.stop()


def answer(client: OpenAI, prompt: str, seen: dict[str, str] | None = None) -> tuple[str, str, object]:
    """(text, finish reason, usage) of one greedy streamed answer; `seen` gets its request id once the
    first text arrives."""
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": prompt}], stream=True,
        temperature=0, max_tokens=MAX_TOKENS, stream_options={"include_usage": True},
    )  # fmt: skip
    text, finish, usage = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        if seen is not None and "".join(text):
            seen.setdefault(prompt, chunk.id.split("-", 1)[1])
    return "".join(text), finish, usage


def worker_pid(dev: DevStack, worker_id: str) -> int:
    for pid in child_pids(dev.process("scaler").popen.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if worker_id.encode() in argv:
            return pid
    raise AssertionError(f"no process for {worker_id}")


def test_greedy_streams_of_a_killed_vllm_worker_go_on_exactly(stack: tuple[DevStack, Endpoints]) -> None:
    dev, endpoints = stack
    client = OpenAI(base_url=endpoints.url + "/v1", api_key=endpoints.api_key, max_retries=0, timeout=300)
    uninterrupted = [answer(client, p) for p in PROMPTS]

    seen: dict[str, str] = {}
    results: dict[str, tuple[str, str, object]] = {}

    def run(prompt: str) -> None:
        results[prompt] = answer(client, prompt, seen)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    names = BusSettings(kafka_bootstrap=endpoints.kafka_bootstrap, redis_url=endpoints.redis_url).names
    redis = sync_redis.Redis.from_url(endpoints.redis_url)
    try:
        deadline = time.monotonic() + 120
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen, "no stream started"
        request_id = next(iter(seen.values()))
        victim = redis.get(names.placement(request_id))
        assert isinstance(victim, bytes)
        os.kill(worker_pid(dev, victim.decode()), signal.SIGKILL)  # mid-answer: text has gone out
        for thread in threads:
            thread.join(300)
        moved = int(redis.hget(names.migrations("smollm2"), "moved") or 0)
    finally:
        redis.close()
    assert [results[p] for p in PROMPTS] == uninterrupted
    assert moved >= 1, "a stream moved off the killed worker"
