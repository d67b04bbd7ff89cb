"""Queue-path overhead: time to first token through the whole dev stack with a zero-cost engine.

The simulated engine is set to 0 ms prefill and 1 ms per token, so the time to first token measured at
the client is the pipeline itself: HTTP, tokenization, Kafka produce and fetch, placement, the Redis
inbox, the worker, pub/sub and SSE. Run: `.venv/bin/python -m bench.pipeline_latency`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from infra.devstack import DevStack, Endpoints

CONFIG = """
[[pools]]
name = "sim"
model = "sluice-sim"
default_max_tokens = 16
replicas = 2

[pools.simulated]
ttft_ms = 0
token_ms = 1
max_running = 256
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_stream(client: httpx.AsyncClient, endpoints: Endpoints, i: int) -> tuple[float, float]:
    body = {
        "model": "sluice-sim",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": f"request {i}: tell me about queues"}],
    }
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", endpoints.url + "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - t0
            if line == "data: [DONE]":
                break
    if ttft is None:
        raise RuntimeError("stream ended without content")
    return ttft, time.perf_counter() - t0


async def run_level(endpoints: Endpoints, concurrency: int, requests: int) -> None:
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await one_stream(client, endpoints, -1)  # warm the connection pool and every consumer
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> tuple[float, float]:
            async with sem:
                return await one_stream(client, endpoints, i)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] * 1000 for r in results]
    totals = [r[1] * 1000 for r in results]
    print(
        f"concurrency {concurrency:>3}  requests {requests:>4}  "
        f"TTFT ms p50 {statistics.median(ttfts):6.1f} p90 {percentile(ttfts, 0.9):6.1f} "
        f"p99 {percentile(ttfts, 0.99):6.1f}  "
        f"total ms p50 {statistics.median(totals):6.1f}  throughput {requests / wall:6.1f} req/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pools.toml"
        config.write_text(CONFIG)
        stack = DevStack(Path(tmp) / "stack", config_path=config)
        endpoints = stack.start()
        try:
            print("pipeline overhead (engine: 0 ms prefill, 1 ms/token, 16 tokens; 2 workers; dev broker)")
            for level in args.concurrency:
                asyncio.run(run_level(endpoints, level, args.requests))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
