"""Chaos on real vLLM: a SmolLM2 worker of the single pool killed (-9) while it streams greedy answers. Its
streams go on from the other worker, and each answer, as the official client reads it, is the very answer
an uninterrupted run gives, with the same usage."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis as sync_redis
from openai import OpenAI

from plumbing.processes import child_pids
from queue_schemas.names import Names
from tests.e2e.dev_cli import DevRun, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

POOL = "single"
PROMPTS = [
    "Describe the sea in three sentences.",
    "List four things a good kitchen has.",
    "Explain what a queue is to a child.",
    "Write a short note about autumn.",
]
MAX_TOKENS = 48


def answer(client: OpenAI, prompt: str, seen: dict[str, str] | None = None) -> tuple[str, str, object]:
    """(text, finish reason, usage) of one greedy streamed answer; `seen` gets its request id once the
    first text arrives."""
    stream = client.chat.completions.create(
        model=POOL, messages=[{"role": "user", "content": prompt}], stream=True,
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


def worker_pid(dev: DevRun, worker_id: str) -> int:
    for pid in child_pids(dev.pids["scaler"]):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if worker_id.encode() in argv:
            return pid
    raise AssertionError(f"no process for {worker_id}")


def test_greedy_streams_of_a_killed_vllm_worker_go_on_exactly(smollm2: DevRun) -> None:
    asyncio.run(wait_ready(smollm2.env["SLUICE_REDIS_URL"], {POOL: 2}))  # a survivor to move to
    client = OpenAI(
        base_url=smollm2.env["SLUICE_URL"] + "/v1", api_key=smollm2.env["SLUICE_API_KEY"], max_retries=0,
        timeout=300,
    )  # fmt: skip
    uninterrupted = [answer(client, p) for p in PROMPTS]

    seen: dict[str, str] = {}
    results: dict[str, tuple[str, str, object]] = {}

    def run(prompt: str) -> None:
        results[prompt] = answer(client, prompt, seen)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    names = Names()
    redis = sync_redis.Redis.from_url(smollm2.env["SLUICE_REDIS_URL"])
    try:
        moved_before = int(redis.hget(names.migrations(POOL), "moved") or 0)
        deadline = time.monotonic() + 120
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen, "no stream started"
        request_id = next(iter(seen.values()))
        victim = redis.get(names.placement(request_id))
        assert isinstance(victim, bytes)
        os.kill(worker_pid(smollm2, victim.decode()), signal.SIGKILL)  # mid-answer: text has gone out
        for thread in threads:
            thread.join(300)
        moved = int(redis.hget(names.migrations(POOL), "moved") or 0) - moved_before
    finally:
        redis.close()
        client.close()
    assert [results[p] for p in PROMPTS] == uninterrupted
    assert moved >= 1, "a stream moved off the killed worker"
