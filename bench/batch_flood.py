"""Interactive time to first token with and without a batch flood beside it, in one run of the dev stack.

Phase 1: N interactive clients stream chat replies through ingress (the simulated engine: 20 ms to the
first token, 10 ms per token after it, 16 slots per worker, 2 workers).
Phase 2: 10,000 batch submissions are produced to batch.<pool> with a plain Kafka producer, and the same
interactive load runs again while the dispatcher works through them. Batch placement leaves a quarter of
each worker's slots and KV blocks to interactive requests.

Printed: p50/p90/p99 TTFT of both phases, their ratio, and the batch answers delivered during phase 2 (the
throughput batch gets from the room interactive load leaves).

Run: `.venv/bin/python -m bench.batch_flood`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.live import dev_stack
from bench.pipeline_latency import percentile, run_many
from infra.devstack import Endpoints

CONFIG = """
[[pools]]
name = "sim"
model = "sluice-sim"
max_queued = 100000

[pools.simulated]
ttft_ms = 20
token_ms = 10
max_running = 16

[pools.scaling]
min_replicas = 2
max_replicas = 2
"""
TEAM = "dev"


def summary(label: str, ttfts: list[float]) -> tuple[float, float]:
    ms = [t * 1000 for t in ttfts]
    p50, p90, p99 = statistics.median(ms), percentile(ms, 0.9), percentile(ms, 0.99)
    print(f"  {label:<28} {len(ms):>5} requests  TTFT ms  p50 {p50:6.1f}  p90 {p90:6.1f}  p99 {p99:6.1f}")
    return p50, p99


async def flood(endpoints: Endpoints, prefix: str, count: int, max_tokens: int) -> float:
    """Produce `count` batch submissions; returns the seconds it took."""
    producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap, linger_ms=5)
    await producer.start()
    t0 = time.perf_counter()
    try:
        sends = []
        for i in range(count):
            body = {
                "model": "sluice-sim",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"batch item {i}: summarise the queue"}],
            }
            sub = {"v": 1, "request_id": f"flood-{i}", "custom_id": f"f{i}", "team": TEAM, "body": body}
            sends.append(await producer.send(f"{prefix}.batch.sim", json.dumps(sub).encode()))
        await asyncio.gather(*sends)
    finally:
        await producer.stop()
    return time.perf_counter() - t0


async def count_answers(endpoints: Endpoints, prefix: str, counts: list[int], stop: asyncio.Event) -> None:
    """Count answers (and completed ones) on the team's results topic into `counts` until `stop`."""
    consumer = AIOKafkaConsumer(
        f"{prefix}.results.{TEAM}",
        bootstrap_servers=endpoints.kafka_bootstrap,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            for records in batch.values():
                counts[0] += len(records)
                counts[1] += sum(b'"status_code":200' in (r.value or b"") for r in records)
    finally:
        await consumer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=8, help="interactive clients")
    parser.add_argument("--requests", type=int, default=600, help="interactive requests per phase")
    parser.add_argument("--tokens", type=int, default=30, help="interactive reply length")
    parser.add_argument("--batch", type=int, default=10_000, help="batch submissions in the flood")
    parser.add_argument("--batch-tokens", type=int, default=16)
    args = parser.parse_args()
    with dev_stack(CONFIG) as (stack, endpoints):
        print(f"{args.streams} interactive streams of {args.tokens} tokens; 2 workers x 16 slots")
        quiet, _ = asyncio.run(run_many(endpoints, "sluice-sim", args.streams, args.requests, args.tokens))
        q50, q99 = summary("alone", [t for t, *_ in quiet])

        counts = [0, 0]

        async def flooded() -> tuple[list[float], float, float]:
            stop = asyncio.Event()
            counter = asyncio.create_task(count_answers(endpoints, stack.prefix, counts, stop))
            producing = asyncio.create_task(flood(endpoints, stack.prefix, args.batch, args.batch_tokens))
            await asyncio.sleep(1.0)  # the dispatcher is taking the flood in
            t0 = time.perf_counter()
            results, _ = await run_many(endpoints, "sluice-sim", args.streams, args.requests, args.tokens)
            phase_s = time.perf_counter() - t0
            stop.set()
            await counter
            return [t for t, *_ in results], await producing, phase_s

        ttfts, produce_s, phase_s = asyncio.run(flooded())
        f50, f99 = summary(f"beside {args.batch} batch", ttfts)
        answered, ok = counts
        print(f"  p50 ratio {f50 / q50:4.2f}   p99 ratio {f99 / q99:4.2f}   (target: p99 ratio <= 1.5)")
        print(
            f"  flood produced in {produce_s:.1f} s; {answered} batch answers ({ok} completed) by the end"
            f" of the {phase_s:.1f} s interactive phase"
        )


if __name__ == "__main__":
    main()
