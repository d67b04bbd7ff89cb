"""Placement decisions per second of one dispatcher process, with 64, 256 and 1,024 workers in view.

Each decision is what the live dispatcher does per request: build the placement inputs from its view
(heartbeats, in-flight placements, each worker's precise prefix index) and run the placement function.
Workers hold 2,000 cached blocks each; prompts are 40 blocks from 150 tenants' shared prefixes.
Run: `.venv/bin/python -m bench.placement_rate`.
"""

from __future__ import annotations

import argparse
import random
import time

import redis.asyncio as aioredis

from dispatcher.placement import Demand, PlacementPolicy, choose
from dispatcher.prefix_index import PreciseIndex
from dispatcher.view import WorkerView
from queue_schemas.messages import Heartbeat, KvSnapshot, WorkerState
from queue_schemas.names import Names
from queue_schemas.prefix import block_hashes

TENANTS = 150
PROMPT_BLOCKS = 40


def build_view(workers: int, rng: random.Random, prompts: list[list[str]]) -> WorkerView:
    # The view is only read here; the client is never used.
    view = WorkerView(aioredis.Redis(), Names(), "sim")
    now = time.time()
    for i in range(workers):
        wid = f"w{i}"
        view.on_heartbeat(
            Heartbeat(
                worker_id=wid,
                pool="sim",
                model="m",
                state=WorkerState.READY,
                seq=1,
                sent_at=now + 3600,
                ttl_ms=10_000_000,
                kv_blocks_total=20_000,
                kv_blocks_free=rng.randrange(5_000, 20_000),
                block_size=16,
                running=rng.randrange(20),
                waiting=rng.randrange(5),
                inbox_pending=0,
                decode_tokens_per_s=0.0,
                started_at=0.0,
                kv_events=True,
            )
        )
        index = PreciseIndex(wid, view.holders)
        held = tuple({h for prompt in rng.sample(prompts, 50) for h in prompt})
        index.load(KvSnapshot(worker_id=wid, seq=1, block_hashes=held, taken_at=now))
        view.precise[wid] = index
    return view


def rate(workers: int, decisions: int, policy_path: str) -> float:
    rng = random.Random(1)
    prompts = [block_hashes([t] * (16 * PROMPT_BLOCKS), 16) for t in range(TENANTS)]
    view = build_view(workers, rng, prompts)
    policy = PlacementPolicy()
    demands = [Demand(16 * PROMPT_BLOCKS, prompts[rng.randrange(TENANTS)], 256) for _ in range(decisions)]
    t0 = time.perf_counter()
    placed = 0
    for demand in demands:
        if policy_path == "table":
            decision = view.decide(demand, time.time(), policy, rng)
        else:
            decision = choose(view.snapshot(demand.block_hashes), demand, time.time(), policy, rng)
        placed += decision.worker_id is not None
    elapsed = time.perf_counter() - t0
    assert placed == decisions
    return decisions / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--decisions", type=int, default=5000)
    args = parser.parse_args()
    for n in args.workers:
        fast, reference = rate(n, args.decisions, "table"), rate(n, args.decisions // 5, "objects")
        print(
            f"{n:>4} workers in view: {fast:8.0f} decisions/s (columnar, live path)"
            f"  {reference:8.0f} decisions/s (reference function over objects)"
        )


if __name__ == "__main__":
    main()
