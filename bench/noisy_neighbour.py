"""A noisy neighbour on one pool: team A sends ten times the request rate of teams B and C.

The dev stack runs one simulated pool of 2 workers whose engine steps are shared by the requests they
run (`batched` timing: 15 ms a step plus 0.15 ms per sequence, so about 20 steps a second), with 8
running slots each, so the pool finishes about 20 requests of 40 tokens a second. Each team's requests
arrive open-loop (Poisson) through its own API key.

Phase 1: B and C alone, each at `--rate` requests per second. Phase 2: the same B and C traffic with A at
ten times that rate beside it, more than the pool can serve. Printed per team: requests answered (A's
backlog drains after the phase), and p50/p90/p99 TTFT (A's includes its wait in the hold).

The stack runs once per worker queue depth (fixed at the cap, `max_queue` 64, as before; and derived
from each worker's completion rate, the default) and per number of light slots a worker keeps for
interactive requests of teams under their share of it (`--light-slots`: 2 by default, as in a pool;
0 for none).

Run: `.venv/bin/python -m bench.noisy_neighbour [--rate 2.5 --seconds 60]` (the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import redis.asyncio as aioredis

from bench.live import dev_stack, stream_chat
from bench.pipeline_latency import percentile
from infra.devstack import Endpoints
from infra.keys import create_key
from queue_schemas.names import Names

CONFIG = """
[[pools]]
name = "shared"
model = "sluice-sim"
max_queued = 100000
queue_timeout_s = 120
light_slots = {light}

[pools.simulated]
timing = "batched"
step_ms = 15
step_ms_per_seq = 0.15
prefill_ms_per_token = 0.01
max_running = 8
min_words = 40
max_words = 40

[pools.scaling]
min_replicas = 2
max_replicas = 2
"""
TOKENS = 40
TEAMS = ("team-a", "team-b", "team-c")


@dataclass
class TeamRun:
    ttfts: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


async def team_keys(endpoints: Endpoints, prefix: str) -> dict[str, str]:
    redis = aioredis.from_url(endpoints.redis_url)
    try:
        return {team: await create_key(redis, Names(prefix=prefix), team) for team in TEAMS}
    finally:
        await redis.aclose()


async def open_loop(
    client: httpx.AsyncClient, endpoints: Endpoints, key: str, rate: float, seconds: float, seed: int
) -> TeamRun:
    """Requests at Poisson arrival times for `seconds`, each on its own, answers read to the end."""
    rng = random.Random(seed)
    run = TeamRun()
    as_team = Endpoints(
        endpoints.url, key, endpoints.kafka_bootstrap, endpoints.redis_url, endpoints.scaler_url
    )

    async def one(i: int) -> None:
        body = {
            "model": "sluice-sim",
            "stream": True,
            "max_tokens": TOKENS,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"request {seed}-{i}: tell me about queues"}],
        }
        try:
            got = await stream_chat(client, as_team, body)
        except (RuntimeError, httpx.HTTPError) as exc:
            reason = str(exc).split(":")[0]
            run.errors[reason] = run.errors.get(reason, 0) + 1
            return
        if got.ttft is not None:
            run.ttfts.append(got.ttft)

    tasks = []
    start = time.perf_counter()
    due = 0.0
    i = 0
    while True:
        due += rng.expovariate(rate)
        if due > seconds:
            break
        await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
        i += 1
    await asyncio.gather(*tasks)
    return run


def line(team: str, run: TeamRun) -> str:
    """A team's answers (a backlog that drains after the phase counts too) and their TTFT."""
    ms = [t * 1000 for t in run.ttfts]
    if not ms:
        return f"  {team:<7} no answers; errors {run.errors}"
    p50, p90, p99 = statistics.median(ms), percentile(ms, 0.9), percentile(ms, 0.99)
    errors = f"; errors {run.errors}" if run.errors else ""
    return (
        f"  {team:<7} {len(ms):>5} answered  TTFT ms  p50 {p50:6.1f}  p90 {p90:6.1f}  p99 {p99:7.1f}{errors}"
    )


async def phases(endpoints: Endpoints, prefix: str, rate: float, seconds: float) -> dict[str, list[TeamRun]]:
    keys = await team_keys(endpoints, prefix)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await open_loop(client, endpoints, keys["team-b"], 4.0, 2.0, 0)  # warm connections and consumers
        alone = await asyncio.gather(
            *(
                open_loop(client, endpoints, keys[t], rate, seconds, s)
                for s, t in ((1, "team-b"), (2, "team-c"))
            )
        )
        rates = {"team-a": 10 * rate, "team-b": rate, "team-c": rate}
        beside = await asyncio.gather(
            *(open_loop(client, endpoints, keys[t], rates[t], seconds, s) for s, t in enumerate(TEAMS, 1))
        )
    return {"alone": list(alone), "beside": list(beside)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=2.5, help="requests/s of B and of C; A sends 10x")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--depths", nargs="+", choices=["fixed", "derived"], default=["fixed", "derived"])
    parser.add_argument(
        "--light-slots", nargs="+", type=int, default=[2], help="light slots per worker (0: none)"
    )
    parser.add_argument(
        "--dispatchers", type=int, default=2, help="dispatchers of the pool (each its own hold)"
    )
    args = parser.parse_args()
    print(
        f"B and C at {args.rate:g} req/s each, A at {10 * args.rate:g}; {TOKENS}-token replies; "
        f"2 workers x 8 slots (batched steps); {args.seconds:g} s per phase"
    )
    for depth in args.depths:
        for light in args.light_slots:
            report(depth, light, args)


def report(depth: str, light: int, args: argparse.Namespace) -> None:
    env = {"SLUICE_QUEUE_DEPTH": depth}
    config = CONFIG.format(light=light)
    with dev_stack(config, extra_env=env, dispatchers=args.dispatchers) as (stack, endpoints):
        runs = asyncio.run(phases(endpoints, stack.prefix, args.rate, args.seconds))
    print(f"\nworker queue depth: {depth}; light slots {light}; {args.dispatchers} dispatcher(s)")
    print(" B and C alone:")
    for team, run in zip(("team-b", "team-c"), runs["alone"], strict=True):
        print(line(team, run))
    print(" with A at 10x:")
    for team, run in zip(TEAMS, runs["beside"], strict=True):
        print(line(team, run))
    for i, team in enumerate(("team-b", "team-c")):
        a = percentile([t * 1000 for t in runs["alone"][i].ttfts], 0.99)
        b = percentile([t * 1000 for t in runs["beside"][i + 1].ttfts], 0.99)
        print(f"  {team} p99 beside A / alone: {b / a:4.2f}   (target: <= 1.5)")


if __name__ == "__main__":
    main()
