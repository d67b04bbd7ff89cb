"""Traffic for the fleet simulator: each workload yields requests in arrival order. Seeded, so repeatable.

Every request carries the `max_tokens` its client would send (a cap above its true output length);
routers see that, never the true length.

Prompts are sequences of block hashes: blocks of a shared context carry the context's name and position,
blocks of a request's own text its id, so two prompts share exactly the leading blocks they share in text
(the chain-hash property of the project's prefix hashes).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.sim.engine import Request

BLOCK = 16


@functools.lru_cache(maxsize=4096)
def blocks_of(prefix: str, start: int, count: int) -> tuple[str, ...]:
    """Memoised: shared contexts are asked for again and again (one request's own blocks pass through)."""
    return tuple(f"{prefix}:{i}" for i in range(start, start + count))


@dataclass(frozen=True)
class Workload:
    name: str
    duration_s: float
    requests: Callable[[random.Random], Iterator[Request]]
    description: str


def poisson_times(
    rng: random.Random, rate: Callable[[float], float], peak: float, until: float
) -> Iterator[float]:
    """Arrival times of a Poisson process with time-varying `rate` (thinning against `peak`)."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= until:
            return
        if rng.random() * peak <= rate(t):
            yield t


def shared_prefix(
    rate: float = 40.0, tenants: int = 150, context: int = 6000, duration_s: float = 600.0
) -> Workload:
    """llm-d's benchmark shape: many tenants, each with a long shared system context, short questions."""

    def gen(rng: random.Random) -> Iterator[Request]:
        for rid, t in enumerate(poisson_times(rng, lambda _: rate, rate, duration_s)):
            tenant = rng.randrange(tenants)
            question = rng.randint(50, 250)
            prompt = context + question
            blocks = blocks_of(f"t{tenant}", 0, context // BLOCK) + blocks_of(f"q{rid}", 0, question // BLOCK)
            yield Request(rid, t, blocks, prompt, rng.randint(100, 300), tenant=tenant, max_tokens=512)

    return Workload(
        "shared-prefix", duration_s, gen,
        f"{tenants} tenants x {context}-token context, {rate:g} req/s, 50-250-token questions, 100-300 out",
    )  # fmt: skip


def multi_turn(rate: float = 6.0, turns: int = 6, duration_s: float = 600.0) -> Workload:
    """Chat sessions: each turn resends the whole conversation so far plus a new message."""

    def gen(rng: random.Random) -> Iterator[Request]:
        pending: list[tuple[float, int, int, int]] = []  # (time, session, turn, history tokens)
        rid = 0
        for session, t in enumerate(poisson_times(rng, lambda _: rate, rate, duration_s)):
            pending.append((t, session, 0, rng.randint(200, 800)))
        pending.sort()
        import heapq

        heapq.heapify(pending)
        while pending:
            t, session, turn, history = heapq.heappop(pending)
            message = rng.randint(30, 200)
            prompt = history + message
            out = rng.randint(80, 400)
            blocks = blocks_of(f"s{session}", 0, prompt // BLOCK)
            yield Request(rid, t, blocks, prompt, out, tenant=session, max_tokens=1024)
            rid += 1
            if turn + 1 < turns:
                think = rng.uniform(10, 40)
                heapq.heappush(pending, (t + think + out * 0.03, session, turn + 1, prompt + out))

    return Workload("multi-turn", duration_s, gen, f"{rate:g} new sessions/s, up to {turns} turns")


def bursty_code(rate: float = 30.0, burst: float = 4.0, duration_s: float = 600.0) -> Workload:
    """Code completion: repository contexts of 2-8k tokens, short answers, arrivals in bursts."""

    def level(t: float) -> float:
        return rate * (burst if int(t // 20) % 3 == 0 else 0.5)

    def gen(rng: random.Random) -> Iterator[Request]:
        repos = 40
        for rid, t in enumerate(poisson_times(rng, level, rate * burst, duration_s)):
            repo = rng.randrange(repos)
            context = 2000 + (repo * 150) % 6000
            edit = rng.randint(20, 200)
            blocks = blocks_of(f"repo{repo}", 0, context // BLOCK) + blocks_of(f"e{rid}", 0, edit // BLOCK)
            yield Request(rid, t, blocks, context + edit, rng.randint(10, 60), tenant=repo, max_tokens=128)

    return Workload("bursty-code", duration_s, gen, f"40 repositories, {rate:g} req/s in x{burst:g} bursts")


def diurnal_rate(t: float, peak: float, day_s: float) -> float:
    """A day: night trough at 15% of the peak, a morning rise, a working plateau, and an evening ramp."""
    h = (t / day_s) * 24.0
    base = 0.15 + 0.45 * max(0.0, math.sin(math.pi * (h - 6) / 12)) if 6 <= h <= 18 else 0.15
    evening = 0.85 * math.exp(-(((h - 20.5) / 1.3) ** 2))
    return peak * min(1.0, base + evening)


def diurnal(peak: float = 6.0, day_s: float = 24 * 3600.0) -> Workload:
    def gen(rng: random.Random) -> Iterator[Request]:
        for rid, t in enumerate(poisson_times(rng, lambda x: diurnal_rate(x, peak, day_s), peak, day_s)):
            sysprompt = rng.randrange(20)
            question = rng.randint(100, 600)
            blocks = blocks_of(f"sys{sysprompt}", 0, 1000 // BLOCK) + blocks_of(
                f"d{rid}", 0, question // BLOCK
            )
            yield Request(
                rid, t, blocks, 1000 + question, rng.randint(100, 400), tenant=sysprompt, max_tokens=512
            )

    return Workload("diurnal", day_s, gen, f"a day, peak {peak:g} req/s in the evening ramp")


FLOOD_AT_S = 60.0


def batch_flood(rate: float = 20.0, batch: int = 20_000, duration_s: float = 600.0) -> Workload:
    """Interactive shared-prefix traffic with a batch of long-output requests submitted at once beside it."""
    interactive = shared_prefix(rate=rate, tenants=60, duration_s=duration_s)

    def gen(rng: random.Random) -> Iterator[Request]:
        flood = [
            Request(1_000_000 + i, FLOOD_AT_S + i * 1e-4, blocks_of(f"b{i}", 0, 40), 640,
                    rng.randint(200, 600), priority="batch", max_tokens=1024)
            for i in range(batch)
        ]  # fmt: skip
        merged = sorted([*interactive.requests(rng), *flood], key=lambda r: r.arrival)
        yield from merged

    return Workload("batch-flood", duration_s, gen, f"{rate:g} req/s interactive + {batch} batch at t=60 s")


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of n items by rank under Zipf's law with exponent s (normalised)."""
    raw = [1 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def lora_zipf(
    rate: float = 30.0, adapters: int = 50, zipf_s: float = 1.0, duration_s: float = 600.0
) -> Workload:
    """Many fine-tunes of one base: each request names one of `adapters` LoRA adapters, chosen by Zipf
    popularity; each adapter has its own 500-1,000-token system prompt (its KV is the adapter's alone),
    then a 100-400-token question; 100-300 tokens out."""

    def gen(rng: random.Random) -> Iterator[Request]:
        weights = zipf_weights(adapters, zipf_s)
        systems = [rng.randint(500, 1000) // BLOCK * BLOCK for _ in range(adapters)]
        for rid, t in enumerate(poisson_times(rng, lambda _: rate, rate, duration_s)):
            adapter = rng.choices(range(adapters), weights)[0]
            question = rng.randint(100, 400)
            system = systems[adapter]
            blocks = blocks_of(f"a{adapter}", 0, system // BLOCK) + blocks_of(f"q{rid}", 0, question // BLOCK)
            yield Request(
                rid, t, blocks, system + question, rng.randint(100, 300), tenant=adapter, max_tokens=512,
                adapter=adapter,
            )  # fmt: skip

    return Workload(
        "lora-zipf", duration_s, gen,
        f"{adapters} adapters (Zipf s={zipf_s:g}), {rate:g} req/s, 500-1,000-token system prompt per "
        "adapter, 100-400-token questions, 100-300 out",
    )  # fmt: skip
