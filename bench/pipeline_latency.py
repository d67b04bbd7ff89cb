"""Queue-path overhead and relay throughput through the whole dev stack, with a zero-cost prefill.

Phase 1 (added latency): N clients each keep one stream open at all times (100 tokens at 10 ms, so about
a second each, like a chat reply), starting the next as soon as one ends. The simulated engine starts its
first token after 0 ms plus 0.002 ms per prompt token, so the time to first token at the client, minus
that, is the pipeline itself: HTTP, tokenization, quota reservation, Kafka produce and fetch, placement,
the Redis inbox, the worker, pub/sub and SSE.
Phase 2 (saturation): N clients sending short requests (16 tokens at 1 ms) back to back: the request rate
the stack sustains and the time to first token at that rate.
Phase 3 (relay): long streams at 1 ms per token; chunks per second one ingress process relays to clients.

Run: `.venv/bin/python -m bench.pipeline_latency [--all-pools] [--tracing off on]`; with both, every
phase runs with tracing off, then on (OTLP export to a receiver on loopback and the Redis timeline).
Client, broker, Redis and every service share the machine, so the figures include their contention. Each
phase gets a stack with only its pool, unless --all-pools asks for one stack with all three.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.live import dev_stack, stream_chat
from infra.devstack import Endpoints

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
) -> tuple[float, int, int, int]:
    """(seconds to first content, content chunks, prompt and completion tokens) of one streamed request."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"request {i}: tell me about queues"}],
    }
    got = await stream_chat(client, endpoints, body)
    if got.ttft is None:
        raise RuntimeError("stream ended without content")
    return got.ttft, got.chunks, got.prompt_tokens, got.completion_tokens


async def run_many(
    endpoints: Endpoints,
    model: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    stagger_s: float = 0.0,
) -> tuple[list[tuple[float, int, int, int]], float]:
    """`concurrency` clients, each sending its next request when the last one ends, until `requests`
    are done. Client i starts after i * stagger_s / concurrency: with stagger_s about one request's
    length the streams stay spread out, as independent users' are; with 0 they start and keep arriving
    together, in bursts of `concurrency`."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await one_stream(client, endpoints, model, -1, max_tokens)  # warm connections and consumers
        numbers = iter(range(requests))
        results: list[tuple[float, int, int, int]] = []

        async def one_client(k: int) -> None:
            await asyncio.sleep(k * stagger_s / concurrency)
            for i in numbers:
                results.append(await one_stream(client, endpoints, model, i, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(k) for k in range(concurrency)))
        return results, time.perf_counter() - t0


def added_latency(
    endpoints: Endpoints, model: str, max_tokens: int, concurrency: int, requests: int, stagger_s: float = 0.0
) -> None:
    results, wall = asyncio.run(run_many(endpoints, model, concurrency, requests, max_tokens, stagger_s))
    added = [(ttft * 1000) - prompt * PROMPT_MS_PER_TOKEN for ttft, _, prompt, _ in results]
    p50, p90, p99 = statistics.median(added), percentile(added, 0.9), percentile(added, 0.99)
    arrivals = "spread" if stagger_s else "together"
    print(
        f"  {concurrency:>3} streams {arrivals:>8}  {requests:>4} requests  added TTFT ms  "
        f"p50 {p50:6.1f}  p90 {p90:6.1f}  p99 {p99:6.1f}  ({requests / wall:5.0f} req/s)"
    )


def relay_rate(endpoints: Endpoints, concurrency: int) -> None:
    results, wall = asyncio.run(run_many(endpoints, "sluice-long", concurrency, concurrency, 2000))
    chunks = sum(c for _, c, _, _ in results)
    tokens = sum(t for _, _, _, t in results)
    print(
        f"  {concurrency:>3} streams  {tokens:>6} tokens in {chunks:>6} chunks in {wall:5.2f} s"
        f"  = {tokens / wall:7.0f} tokens/s, {chunks / wall:6.0f} chunks/s relayed"
    )


def pool_config(name: str) -> str:
    """The one pool a phase uses: an idle pool's dispatcher still long-polls the dev broker (Tansu answers
    a waiting fetch only when its wait expires), which costs these 2 cores about a tenth of one each."""
    (section,) = [p for p in CONFIG.split("[[pools]]")[1:] if f'name = "{name}"' in p]
    return "[[pools]]" + section


def with_stack(pools: str, fetch_wait_ms: int, phase: Callable[[Endpoints], None], traced: bool) -> None:
    env = {"SLUICE_KAFKA_FETCH_WAIT_MS": str(fetch_wait_ms)}
    if not traced:
        with dev_stack(pools, extra_env=env) as (_, endpoints):
            phase(endpoints)
        return
    with tempfile.TemporaryDirectory() as tmp, otlp_sink(Path(tmp)) as endpoint:
        # Every service exports its spans over OTLP/HTTP to a receiver in a process of its own, and
        # records each request's timeline in Redis, as `sluice dev` does.
        env |= {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "SLUICE_TRACE_TIMELINE": "1",
        }
        with dev_stack(pools, extra_env=env) as (_, endpoints):
            phase(endpoints)


@contextmanager
def otlp_sink(tmp: Path) -> Iterator[str]:
    """bench.otlp_sink in a subprocess (so decoding spans takes nothing from the client's process)."""
    port_file = tmp / "otlp.port"
    sink = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", "--port-file", str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text()):
            if sink.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the OTLP sink did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        sink.send_signal(signal.SIGTERM)
        sink.wait(30)


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
    parser.add_argument(
        "--all-pools", action="store_true", help="one stack with the three pools for every phase"
    )
    parser.add_argument(
        "--phases", nargs="+", choices=["chat", "sim", "long"], default=["chat", "sim", "long"],
        help="which phases to run (by pool): chat = added latency, sim = saturation, long = relay",
    )  # fmt: skip
    parser.add_argument(
        "--tracing", nargs="+", choices=["off", "on"], default=["off"],
        help="run every phase with tracing off, on (OTLP export and the Redis timeline), or both in turn",
    )  # fmt: skip
    args = parser.parse_args()
    print(
        f"dev broker, dispatcher fetch wait {args.fetch_wait_ms} ms, "
        f"{'all three pools in one stack' if args.all_pools else 'a stack with only the pool of each phase'}"
    )

    def open_streams(endpoints: Endpoints) -> None:
        print("added time to first token, N streams open (100 tokens at 10 ms each; 2 workers)")
        print("  together: the N clients start at once and keep arriving in bursts of N;")
        print("  spread: client i starts i/N of a request's length later, as independent users do")
        for level in args.concurrency:
            requests = max(args.requests if level > 1 else args.requests // 3, 3 * level)
            added_latency(endpoints, "sluice-chat", 100, level, requests)
            if level > 1:
                added_latency(endpoints, "sluice-chat", 100, level, requests, stagger_s=1.0)

    def saturation(endpoints: Endpoints) -> None:
        print("saturation: N clients back to back (16 tokens at 1 ms each; 2 workers)")
        for level in args.concurrency:
            added_latency(endpoints, "sluice-sim", 16, level, args.requests)

    def relay(endpoints: Endpoints) -> None:
        print("SSE relay throughput of one ingress process (engine: 1 ms/token, 2000-token answers)")
        for level in args.relay_streams:
            relay_rate(endpoints, level)

    phases = [
        (p, f) for p, f in [("chat", open_streams), ("sim", saturation), ("long", relay)] if p in args.phases
    ]
    for mode in args.tracing:
        print(f"== tracing {mode}")
        traced = mode == "on"
        if args.all_pools:

            def every_phase(endpoints: Endpoints) -> None:
                for _, phase in phases:
                    phase(endpoints)

            with_stack(CONFIG, args.fetch_wait_ms, every_phase, traced)
            continue
        for pool, phase in phases:
            with_stack(pool_config(pool), args.fetch_wait_ms, phase, traced)


if __name__ == "__main__":
    main()
