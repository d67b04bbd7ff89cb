"""The fleet simulator against the live stack: one trace, one timing model, two runs, side by side.

The trace: shared-prefix chat (12 tenants, each with a 3,000-character context, 50-250-character
questions, 100-300 tokens out) with Poisson arrivals at each rate. It runs through `sluice dev` (the
simulated engine with `batched` timing: engine steps shared by the running requests, as the simulator
models a replica; 2 workers) with streamed chat completions over HTTP, and through `bench/sim` with the
same timing model, the same prompts (token counts and prefix hashes computed as the ingress computes
them), the project's placement and heartbeat views of the workers' heartbeat age.

Printed per rate: TTFT p50/p90 and output tokens/s of both, and sim / live. The simulator runs twice:
with its own placement, and replaying the live run's (each request on the worker the live dispatcher
chose, read back from the placement records), which separates the replica model from the placement's
random tie-breaks: which worker each tenant lands on first decides how the load splits.

Run: `.venv/bin/python -m bench.sim_fidelity [--rates 3 6 9] [--duration 60]`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis

from bench.live import dev_stack, stream_chat
from bench.pipeline_latency import percentile
from bench.sim.engine import Request, TimingModel
from bench.sim.fleet import simulate
from bench.sim.routers import Router, make_router
from bench.sim.views import ReplicaView
from infra.devstack import DEV_TEAM, Endpoints
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.names import Names
from queue_schemas.prefix import block_hashes, cache_salt

WORKERS = 2
BLOCK = 16
STEP_MS, STEP_MS_PER_SEQ, PREFILL_MS_PER_TOKEN, CHUNK = 20.0, 0.5, 0.02, 2048
KV_BLOCKS, MAX_RUNNING = 40_000, 32
HEARTBEAT_S = 1.0  # the workers' heartbeat interval

CONFIG = f"""
[[pools]]
name = "sim"
model = "sluice-sim"
engine = "simulated"
tokenizer = "bytes"
context_tokens = 8192
default_max_tokens = 128
block_size = {BLOCK}
partitions = 4
max_queued = 100000

[pools.simulated]
timing = "batched"
step_ms = {STEP_MS}
step_ms_per_seq = {STEP_MS_PER_SEQ}
prefill_ms_per_token = {PREFILL_MS_PER_TOKEN}
chunk_tokens = {CHUNK}
kv_blocks = {KV_BLOCKS}
max_running = {MAX_RUNNING}
min_words = 200
max_words = 200

[pools.scaling]
min_replicas = {WORKERS}
max_replicas = {WORKERS}
"""

MODEL = TimingModel(
    decode_base_s=STEP_MS / 1000, decode_per_seq_s=STEP_MS_PER_SEQ / 1000,
    prefill_per_token_s=PREFILL_MS_PER_TOKEN / 1000, chunk_tokens=CHUNK, kv_blocks=KV_BLOCKS,
    block_size=BLOCK, max_seqs=MAX_RUNNING,
)  # fmt: skip


@dataclass(frozen=True)
class Item:
    at: float
    text: str
    output: int
    tenant: int


def trace(rate: float, duration: float, seed: int) -> list[Item]:
    rng = random.Random(seed)
    words = ["queues", "carry", "requests", "to", "replicas", "whose", "caches", "hold", "their", "context"]
    contexts = [
        f"tenant {t}: " + " ".join(rng.choice(words) for _ in range(600)) for t in range(12)
    ]  # fmt: skip
    contexts = [c[:3000] for c in contexts]
    items: list[Item] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return items
        question = " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))[: rng.randint(50, 250)]
        tenant = rng.randrange(len(contexts))
        text = f"{contexts[tenant]}\n\nQuestion: {question}"
        items.append(Item(t, text, rng.randint(100, 300), tenant))


def sim_requests(items: list[Item], team: str) -> list[Request]:
    tokenizer, salt = ByteTokenizer(), cache_salt(team, False)
    out = []
    for rid, item in enumerate(items):
        tokens = tokenizer.encode_chat([ChatMessage(role="user", content=item.text)])
        blocks = tuple(block_hashes(tokens, BLOCK, salt=salt))
        out.append(
            Request(
                rid, item.at, blocks, len(tokens), item.output, tenant=item.tenant, max_tokens=item.output
            )
        )
    return out


@dataclass
class Figures:
    ttft_p50: float
    ttft_p90: float
    tokens_per_s: float
    completed: int
    workers: list[int]  # the worker each request ran on, by position in the trace (0 .. WORKERS-1)

    def split(self, items: list[Item]) -> str:
        """Requests per worker, and the tenants each worker served most of."""
        counts = [self.workers.count(w) for w in range(WORKERS)]
        tenants: list[list[int]] = [[] for _ in range(WORKERS)]
        for tenant in sorted({i.tenant for i in items}):
            ran = [w for w, i in zip(self.workers, items, strict=True) if i.tenant == tenant]
            tenants[max(range(WORKERS), key=ran.count)].append(tenant)
        return " / ".join(f"{c} ({len(t)} tenants)" for c, t in zip(counts, tenants, strict=True))


class ReplayRouter:
    """Each request on the replica a given placement chose (request id -> replica index)."""

    name = "replay"

    def __init__(self, placement: list[int]) -> None:
        self.placement = placement

    def observe(self, views: Sequence[ReplicaView], now: float) -> None:
        return None

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        return next(v for v in views if v.index == self.placement[request.rid])


def simulated(items: list[Item], team: str, seed: int, router: Callable[[], Router]) -> Figures:
    requests = sim_requests(items, team)
    done: list[Request] = []

    def gen(_: random.Random) -> Iterator[Request]:
        return iter(requests)

    end = items[-1].at
    simulate(
        router, MODEL, gen, end, WORKERS, seed=seed, heartbeat_s=HEARTBEAT_S, views="heartbeat", sink=done,
    )  # fmt: skip
    done.sort(key=lambda r: r.rid)
    ttft = [r.first_token - r.arrival for r in done]
    last = max(r.done for r in done)
    return Figures(
        percentile(ttft, 0.5), percentile(ttft, 0.9), sum(r.output_tokens for r in done) / last, len(done),
        [r.replica for r in done],
    )  # fmt: skip


async def one(
    client: httpx.AsyncClient, endpoints: Endpoints, item: Item, t0: float
) -> tuple[float, float, int, str]:
    """(TTFT, end time from the trace's start, output tokens, request id) of one streamed request, sent on
    time."""
    await asyncio.sleep(max(0.0, t0 + item.at - time.perf_counter()))
    body = {
        "model": "sluice-sim", "stream": True, "max_tokens": item.output,
        "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": item.text}],
    }  # fmt: skip
    got = await stream_chat(client, endpoints, body)
    if got.ttft is None:
        raise RuntimeError("stream ended without content")
    return (
        got.ttft,
        time.perf_counter() - t0,
        got.completion_tokens,
        got.completion_id.removeprefix("chatcmpl-"),
    )


async def placements(endpoints: Endpoints, request_ids: list[str]) -> list[int]:
    """The worker each request was placed on (as an index into the sorted worker ids), from the
    dispatcher's placement records."""
    names = Names()
    redis = aioredis.from_url(endpoints.redis_url)
    try:
        found = await redis.mget([names.placement(rid) for rid in request_ids])
    finally:
        await redis.aclose()
    if any(w is None for w in found):
        raise RuntimeError("a request has no placement record")
    ids = sorted({w for w in found if w is not None})
    if len(ids) > WORKERS:
        raise RuntimeError(f"requests ran on {len(ids)} workers, not {WORKERS}")
    return [ids.index(w) for w in found if w is not None]


async def live(endpoints: Endpoints, items: list[Item]) -> Figures:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        warm = Item(0.0, "warm up", 4, -1)
        await one(client, endpoints, warm, time.perf_counter())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, endpoints, item, t0) for item in items))
    ttft = [r[0] for r in results]
    last = max(r[1] for r in results)
    workers = await placements(endpoints, [r[3] for r in results])
    return Figures(
        percentile(ttft, 0.5), percentile(ttft, 0.9), sum(r[2] for r in results) / last, len(results), workers
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[3.0, 6.0, 9.0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with dev_stack(CONFIG) as (_, endpoints):
        for i, rate in enumerate(args.rates):
            items = trace(rate, args.duration, args.seed + i)
            real = asyncio.run(live(endpoints, items))
            seed = args.seed + i
            own = simulated(items, DEV_TEAM, seed, functools.partial(make_router, "sluice", seed))
            replay = simulated(items, DEV_TEAM, seed, functools.partial(ReplayRouter, real.workers))
            rows.append((rate, len(items), real, own, replay))
            for label, f in (("live", real), ("sim", own), ("sim, live placement", replay)):
                print(
                    f"rate {rate:g} {label}: TTFT p50 {f.ttft_p50 * 1000:.0f} ms, "
                    f"p90 {f.ttft_p90 * 1000:.0f} ms, {f.tokens_per_s:,.0f} tokens/s; "
                    f"requests per worker {f.split(items)}",
                    flush=True,
                )
    print(
        f"\n{WORKERS} workers; step {STEP_MS:g} ms + {STEP_MS_PER_SEQ:g} ms per decoding sequence "
        f"+ {PREFILL_MS_PER_TOKEN:g} ms per prefilled token (up to {CHUNK} a step); "
        f"{args.duration:g} s per rate"
    )
    print("| req/s | requests | placement | TTFT p50 ms live / sim | TTFT p90 ms live / sim "
          "| tokens/s live / sim | sim / live: p50, p90, tokens/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate, n, real, own, replay in rows:
        for label, sim in (("simulator's own", own), ("live run's", replay)):
            print(
                f"| {rate:g} | {n} | {label} | {real.ttft_p50 * 1000:.0f} / {sim.ttft_p50 * 1000:.0f} "
                f"| {real.ttft_p90 * 1000:.0f} / {sim.ttft_p90 * 1000:.0f} "
                f"| {real.tokens_per_s:,.0f} / {sim.tokens_per_s:,.0f} "
                f"| {sim.ttft_p50 / real.ttft_p50:.2f}, {sim.ttft_p90 / real.ttft_p90:.2f}, "
                f"{sim.tokens_per_s / real.tokens_per_s:.2f} |"
            )


if __name__ == "__main__":
    main()
