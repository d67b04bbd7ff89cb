"""Prefill/decode disaggregation through `sluice dev`: the split SmolLM2 pool (one prefill and one decode
worker) beside the single pool of the same model for reference. A long prompt is split (its records name
both workers), a short one is not, and both answers equal the single worker's; a prefill worker killed
mid-handoff still leaves a correct answer."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis

from plumbing.processes import child_pids
from queue_schemas.names import Names
from tests.e2e.dev_cli import DevRun, pool_heartbeats, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

WORDS = ["river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "thunder", "orchard", "candle"]


def long_prompt(seed: int) -> str:
    """About 800 tokens of text, different for each seed (so no prefix is shared between tests)."""
    words = [WORDS[(i * seed + i // 7) % len(WORDS)] for i in range(700)]
    return f"Notes {seed}: " + " ".join(words) + "\nSummarise the notes above in one sentence."


async def _placement(dev: DevRun, rid: str) -> str:
    redis = aioredis.Redis.from_url(dev.env["SLUICE_REDIS_URL"], decode_responses=True)
    try:
        return str(await redis.get(Names().placement(rid)))
    finally:
        await redis.aclose()


async def _handoff(dev: DevRun, rid: str) -> dict[str, str]:
    redis = aioredis.Redis.from_url(dev.env["SLUICE_REDIS_URL"], decode_responses=True)
    try:
        record = await redis.hgetall(Names().handoff(rid))
        return {str(k): str(v) for k, v in record.items()}
    finally:
        await redis.aclose()


def ask(dev: DevRun, model: str, prompt: str) -> tuple[str, str, str]:
    """A greedy streamed chat answer: (request id, text, the worker its placement record names)."""
    client = openai.OpenAI(
        base_url=dev.env["SLUICE_URL"] + "/v1", api_key=dev.env["SLUICE_API_KEY"], max_retries=0
    )
    with client:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        rid, text = "", list[str]()
        for chunk in stream:
            rid = rid or chunk.id.split("-", 1)[1]
            text.extend(c.delta.content or "" for c in chunk.choices)
    # Read once the answer is in: the stream opens with the assistant's role before the request is placed.
    return rid, "".join(text), asyncio.run(_placement(dev, rid))


def handoff(dev: DevRun, rid: str) -> dict[str, str]:
    return asyncio.run(_handoff(dev, rid))


def ready(dev: DevRun) -> DevRun:
    """The stack, once the split pool's two workers and a single worker are ready (a worker killed by an
    earlier test is back)."""
    asyncio.run(wait_ready(dev.env["SLUICE_REDIS_URL"], {"split": 2, "single": 1}))
    return dev


def workers(dev: DevRun) -> tuple[str, str]:
    beats = asyncio.run(pool_heartbeats(dev.env["SLUICE_REDIS_URL"], "split"))
    prefill = next(hb.worker_id for hb in beats if hb.role == "prefill" and hb.state == "ready")
    decode_ = next(hb.worker_id for hb in beats if hb.role == "decode")
    return prefill, decode_


def test_a_long_prompt_is_split_a_short_one_is_not_and_both_answer_as_one_worker(smollm2: DevRun) -> None:
    run = ready(smollm2)
    prefill, decode_ = workers(run)
    prompt = long_prompt(3)
    rid, text, placed = ask(run, "split", prompt)
    record = handoff(run, rid)
    # The placement record names the decode worker; the handoff record both, and the KV was loaded.
    assert placed == decode_
    assert record["prefill_worker"] == prefill
    assert record["decode_worker"] == decode_
    assert record["outcome"] == "loaded"
    print(f"handoff: waited {record['waited_s']} s, prefill {record['prefill_s']} s")
    _, single_text, _ = ask(run, "single", prompt)
    assert text == single_text
    assert text
    short_rid, short_text, short_placed = ask(run, "split", "Name three colours.")
    assert short_placed == decode_
    assert handoff(run, short_rid) == {}  # not split
    assert short_text == ask(run, "single", "Name three colours.")[1]


def worker_processes(dev: DevRun, worker_id: str) -> list[int]:
    """The worker's process and its engine's."""
    for pid in child_pids(dev.pids["scaler"]):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if worker_id.encode() in argv:
            return [pid, *child_pids(pid)]
    raise AssertionError(f"no process for {worker_id}")


async def _placements(dev: DevRun) -> set[bytes]:
    redis = aioredis.Redis.from_url(dev.env["SLUICE_REDIS_URL"])
    try:
        return {key async for key in redis.scan_iter(match=Names().placement("*"))}
    finally:
        await redis.aclose()


def _placed(dev: DevRun, before: set[bytes]) -> None:
    """Wait for a request placed after `before` was read."""
    for _ in range(2400):
        if asyncio.run(_placements(dev)) - before:
            return
        time.sleep(0.05)
    raise AssertionError("the request was not placed")


def test_a_prefill_worker_killed_mid_handoff_leaves_a_correct_answer(smollm2: DevRun) -> None:
    run = ready(smollm2)
    prefill, decode_ = workers(run)
    pids = worker_processes(run, prefill)
    prompt = long_prompt(5)
    # Frozen, the prefill worker still looks ready to the dispatcher for its heartbeat's lifetime, so the
    # request is split onto it, and the job sent to it is never run; then it is killed.
    # Once the request is placed with its handoff, the KV can never come back: whether its decode worker
    # has sent the job yet (a BLPOP the frozen worker left waiting takes it) or sends it after the kill, the
    # kill falls in the middle of the handoff.
    before = asyncio.run(_placements(run))
    os.kill(pids[0], signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, run, "split", prompt)
        _placed(run, before)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rid, text, placed = answer.result(timeout=300)
    record = handoff(run, rid)
    assert placed == decode_
    assert record["prefill_worker"] == prefill
    assert record["outcome"] == "prefill worker lost"
    print(f"fell back {time.monotonic() - killed_at:.1f} s after the kill; waited {record['waited_s']} s")
    assert text == ask(run, "single", prompt)[1]
    assert text
