"""Prefill/decode handoffs through the live dispatcher and workers on the real bus (simulated engines): a
long prompt is split onto the prefill worker and its KV counted as loaded, a short one is not, a handoff
a Kafka record claims for itself is ignored, and a prefill worker too slow for the wait leaves a local
prefill with the same answer."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpu_workers.simulated import reply_text
from queue_schemas.codec import decode, encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import FinalChunk, Handoff, Heartbeat, InferenceRequest, TokenChunk
from queue_schemas.prefix import block_hashes
from tests.conftest import Bus
from tests.integration.helpers import Pipeline, make_request, pipeline
from tests.integration.test_dispatch_path import send_and_collect
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)

SPLIT_POOL = """
[[pools]]
name = "sim"
model = "sluice-sim"
[pools.scaling.prefill]
min_replicas = 1
max_replicas = 1
[pools.disaggregation]
{disaggregation}
"""
THRESHOLD = 'mode = "threshold"\nthreshold_tokens = 160\nhandoff_wait_s = {wait}'
DECODE = SimulatedEngineConfig(ttft_ms=5, token_ms=1)


def prompt_request(rid: str, tokens: int, seed: int = 0) -> InferenceRequest:
    req = make_request("sim", rid, max_tokens=20)
    prompt = tuple((i * 7 + seed) % 200 + 30 for i in range(tokens))
    return req.model_copy(
        update={"prompt_token_ids": prompt, "block_hashes": tuple(block_hashes(prompt, 16))}
    )


def text_of(events: Sequence[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenChunk | FinalChunk))


async def test_a_long_prompt_is_split_and_a_short_one_is_not(bus: Bus, tmp_path: Path) -> None:
    config = tmp_path / "pools.toml"
    config.write_text(SPLIT_POOL.format(disaggregation=THRESHOLD.format(wait=10)))
    async with pipeline(bus, engines=[DECODE, DECODE], roles=["decode", "prefill"], config=config) as p:
        names = p.settings.names
        # A record that names its own handoff (to a worker of its choosing) gets the dispatcher's instead.
        forged = Handoff(id=secrets.token_hex(16), prefill_worker="ghost", wait_s=600)
        long = prompt_request("req-split-long-0001", 300).model_copy(update={"handoff": forged})
        events = await send_and_collect(p, long)
        final = events[-1]
        assert isinstance(final, FinalChunk), events
        assert final.worker_id == "w0"
        assert text_of(events) == reply_text(long)[:20]
        record = await p.redis.hgetall(names.handoff(long.request_id))
        assert record[b"prefill_worker"] == b"w1"
        assert record[b"decode_worker"] == b"w0"
        assert record[b"outcome"] == b"loaded"
        # The loaded KV counts as cached: whole blocks of the prompt less its last token.
        assert final.usage.cached_tokens == (300 - 1) // 16 * 16
        short = prompt_request("req-split-short-001", 100)
        events = await send_and_collect(p, short)
        assert isinstance(events[-1], FinalChunk)
        assert events[-1].worker_id == "w0"
        assert text_of(events) == reply_text(short)[:20]
        assert await p.redis.exists(names.handoff(short.request_id)) == 0
        totals = await p.redis.hgetall(names.handoff_totals("sim"))
        assert int(totals[b"loaded"]) == 1
        assert b"fallback" not in totals


async def test_a_prefill_worker_slower_than_the_wait_leaves_a_local_prefill(bus: Bus, tmp_path: Path) -> None:
    config = tmp_path / "pools.toml"
    config.write_text(SPLIT_POOL.format(disaggregation=THRESHOLD.format(wait=0.5)))
    slow = SimulatedEngineConfig(ttft_ms=3000, token_ms=1)
    async with pipeline(bus, engines=[DECODE, slow], roles=["decode", "prefill"], config=config) as p:
        req = prompt_request("req-split-slow-0001", 300)
        events = await send_and_collect(p, req)
        final = events[-1]
        assert isinstance(final, FinalChunk), events
        assert text_of(events) == reply_text(req)[:20]
        assert final.usage.cached_tokens == 0  # prefilled where it decoded
        record = await p.redis.hgetall(p.settings.names.handoff(req.request_id))
        # It stopped waiting at the pool's 0.5 s, not after the prefill's 3 s: a KV that came back would
        # have been loaded (outcome `loaded`, its tokens cached).
        assert record[b"outcome"] == b"timed out"


async def test_auto_splits_a_long_prompt_only_while_the_decode_worker_is_busy(
    bus: Bus, tmp_path: Path
) -> None:
    config = tmp_path / "pools.toml"
    config.write_text(SPLIT_POOL.format(disaggregation='mode = "auto"'))
    decode = SimulatedEngineConfig(ttft_ms=5, token_ms=30, prefill_ms_per_token=0.5)  # 2,000 tokens/s
    async with pipeline(bus, engines=[decode, DECODE], roles=["decode", "prefill"], config=config) as p:
        names = p.settings.names
        # Idle: prefilling 2,000 tokens where it decodes (1 s at its 2,000 tokens/s) is cheaper than the
        # same on the prefill worker (the pool's default rate until it measures one) plus the transfer.
        idle = prompt_request("req-auto-idle-00001", 2000)
        events = await send_and_collect(p, idle)
        assert isinstance(events[-1], FinalChunk)
        assert await p.redis.exists(names.handoff(idle.request_id)) == 0
        # Busy: a local prefill would also hold up the requests running there.
        for i in range(4):
            await p.producer.send_and_wait(
                names.requests_topic("sim"),
                encode(make_request("sim", f"req-auto-busy-{i:05d}", max_tokens=200)),
            )
        await eventually(lambda: running_at_least(p, "w0", 3), 10, "the decode worker runs the slow requests")
        busy = prompt_request("req-auto-busy-long1", 2000, seed=1)  # not the cached one
        events = await send_and_collect(p, busy)
        assert isinstance(events[-1], FinalChunk), events
        assert text_of(events) == reply_text(busy)[:20]
        record = await p.redis.hgetall(names.handoff(busy.request_id))
        assert record[b"outcome"] == b"loaded"


async def running_at_least(p: Pipeline, worker_id: str, count: int) -> bool:
    raw = await p.redis.get(p.settings.names.heartbeat("sim", worker_id))
    return raw is not None and decode(Heartbeat, raw).running >= count
