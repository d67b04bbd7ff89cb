"""Queue-path overhead and relay throughput through the whole dev stack, with a zero-cost prefill.

Phase 1 (added latency): N clients each keep one stream open at all times (100 tokens at 10 ms, so about
a second each, like a chat reply), starting the next as soon as one ends. The simulated engine starts its
first token after 0 ms plus 0.002 ms per prompt token, so the time to first token at the client, minus
that, is the pipeline itself: HTTP, tokenization, quota reservation, Kafka produce and fetch, placement,
the Redis inbox, the worker, pub/sub and SSE.
Phase 2 (saturation): N clients sending short requests (16 tokens at 1 ms) back to back: the request rate
the stack sustains and the time to first token at that rate.
Phase 3 (relay): long streams at 1 ms per token; chunks per second one ingress process relays to clients.

Run: `.venv/bin/python -m bench.pipeline_latency`. Client, broker, Redis and every service share the
machine, so the figures include their contention.
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
max_queued = 100000

[pools.simulated]
ttft_ms = 0
token_ms = 1
max_running = 512

[pools.scaling]
min_replicas = 2
max_replicas = 2

[[pools]]
name = "chat"
model = "sluice-chat"
max_queued = 100000

[pools.simulated]
ttft_ms = 0
token_ms = 10
max_running = 512
min_words = 100
max_words = 100

[pools.scaling]
min_replicas = 2
max_replicas = 2

[[pools]]
name = "long"
model = "sluice-long"
default_max_tokens = 2000
max_queued = 100000

[pools.simulated]
ttft_ms = 0
token_ms = 1
max_running = 512
min_words = 400
max_words = 400

[pools.scaling]
min_replicas = 2
max_replicas = 2
"""
PROMPT_MS_PER_TOKEN = 0.002  # the simulated engine's own prefill cost


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_stream(
    client: httpx.AsyncClient, endpoints: Endpoints, model: str, i: int, max_tokens: int
) -> tuple[float, int, int]:
    """(seconds to first content, content chunks, prompt tokens) of one streamed request."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"request {i}: tell me about queues"}],
    }
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    prompt_tokens = 0
    async with client.stream("POST", endpoints.url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            elif '"prompt_tokens":' in line:
                prompt_tokens = int(line.split('"prompt_tokens":')[1].split(",")[0])
            if line == "data: [DONE]":
                break
    if ttft is None:
        raise RuntimeError("stream ended without content")
    return ttft, chunks, prompt_tokens


async def run_many(
    endpoints: Endpoints, model: str, concurrency: int, requests: int, max_tokens: int
) -> tuple[list[tuple[float, int, int]], float]:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await one_stream(client, endpoints, model, -1, max_tokens)  # warm connections and consumers
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> tuple[float, int, int]:
            async with sem:
                return await one_stream(client, endpoints, model, i, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        return list(results), time.perf_counter() - t0


def added_latency(endpoints: Endpoints, model: str, max_tokens: int, concurrency: int, requests: int) -> None:
    results, wall = asyncio.run(run_many(endpoints, model, concurrency, requests, max_tokens))
    added = [(ttft * 1000) - prompt * PROMPT_MS_PER_TOKEN for ttft, _, prompt in results]
    p50, p90, p99 = statistics.median(added), percentile(added, 0.9), percentile(added, 0.99)
    print(
        f"  {concurrency:>3} streams  {requests:>4} requests  added TTFT ms  "
        f"p50 {p50:6.1f}  p90 {p90:6.1f}  p99 {p99:6.1f}  ({requests / wall:5.0f} req/s)"
    )


def relay_rate(endpoints: Endpoints, concurrency: int) -> None:
    results, wall = asyncio.run(run_many(endpoints, "sluice-long", concurrency, concurrency, 2000))
    chunks = sum(c for _, c, _ in results)
    print(
        f"  {concurrency:>3} streams  {chunks:>6} chunks in {wall:5.2f} s"
        f"  = {chunks / wall:7.0f} chunks/s relayed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--relay-streams", type=int, nargs="+", default=[10, 100])
    parser.add_argument(
        "--fetch-wait-ms", type=int, default=5, help="dispatcher fetch wait on the dev broker"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pools.toml"
        config.write_text(CONFIG)
        env = {"SLUICE_KAFKA_FETCH_WAIT_MS": str(args.fetch_wait_ms)}
        stack = DevStack(Path(tmp) / "stack", config_path=config, extra_env=env)
        endpoints = stack.start()
        try:
            print(f"dev broker, dispatcher fetch wait {args.fetch_wait_ms} ms")
            print("added time to first token, N streams open (100 tokens at 10 ms each; 2 workers)")
            for level in args.concurrency:
                added_latency(endpoints, "sluice-chat", 100, level, max(args.requests // 3, 3 * level))
            print("saturation: N clients back to back (16 tokens at 1 ms each; 2 workers)")
            for level in args.concurrency:
                added_latency(endpoints, "sluice-sim", 16, level, args.requests)
            print("SSE relay throughput of one ingress process (engine: 1 ms/token, 2000-token answers)")
            for level in args.relay_streams:
                relay_rate(endpoints, level)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
