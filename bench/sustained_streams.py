"""Sustained load: N concurrent SSE streams held open on one ingress process, for minutes.

Each of N clients keeps one streamed chat request open at all times: the simulated engine sends one
token a second (about a minute per answer), and the client starts its next request when one ends. Every
few seconds the bench prints the streams open, the answers completed, the errors, and the resident memory
of the ingress process; at the end, whether memory stayed bounded (the last third of the run against the
middle third) and every error seen.

Run: `.venv/bin/python -m bench.sustained_streams [--streams 1000] [--duration 300]`. Client, broker,
Redis and every service share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.live import dev_stack
from infra.devstack import Endpoints

POOLS = """
[[pools]]
name = "hold"
model = "sluice-hold"
default_max_tokens = 100
max_queued = 100000

[pools.simulated]
ttft_ms = 5
token_ms = {token_ms}
max_running = {per_worker}
kv_blocks = 65536
min_words = 8
max_words = 10

[pools.scaling]
min_replicas = 2
max_replicas = 2
"""


@dataclass
class Tally:
    open: int = 0
    completed: int = 0
    chunks: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def one_stream(client: httpx.AsyncClient, endpoints: Endpoints, tally: Tally, n: int) -> None:
    body = {
        "model": "sluice-hold",
        "stream": True,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": f"hold the line {n}"}],
    }
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    tally.open += 1
    try:
        async with client.stream(
            "POST", endpoints.url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status_code != 200:
                tally.errors[f"HTTP {response.status_code}"] += 1
                await response.aread()
                return
            finished = False
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    if '"error"' in line[:20]:
                        tally.errors["error event"] += 1
                        return
                    tally.chunks += 1
                    finished = finished or '"finish_reason":"' in line
                elif line == "data: [DONE]":
                    break
            if finished:
                tally.completed += 1
            else:
                tally.errors["ended without a finish"] += 1
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1
    finally:
        tally.open -= 1


async def hold(endpoints: Endpoints, streams: int, duration_s: float, ingress_pid: int) -> None:
    tally = Tally()
    stop = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    samples: list[tuple[float, float]] = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(180, connect=30)) as client:

        async def client_loop(k: int) -> None:
            await asyncio.sleep(k * 5.0 / streams)  # ramp up over five seconds
            n = 0
            while time.monotonic() < stop:
                await one_stream(client, endpoints, tally, k * 1_000_000 + n)
                n += 1

        async def report() -> None:
            start = time.monotonic()
            print(f"{'t s':>6} {'open':>6} {'done':>7} {'chunks/s':>9} {'errors':>7} {'ingress RSS MB':>15}")
            last_chunks, last_t = 0, start
            while True:
                await asyncio.sleep(10)
                now = time.monotonic()
                rss = rss_mb(ingress_pid)
                samples.append((now - start, rss))
                rate = (tally.chunks - last_chunks) / (now - last_t)
                last_chunks, last_t = tally.chunks, now
                errors = sum(tally.errors.values())
                row = f"{now - start:6.0f} {tally.open:6d} {tally.completed:7d} {rate:9.0f} {errors:7d}"
                print(f"{row} {rss:15.1f}", flush=True)

        reporter = asyncio.create_task(report())
        await asyncio.gather(*(client_loop(k) for k in range(streams)))
        reporter.cancel()
    thirds = len(samples) // 3
    middle = [r for _, r in samples[thirds : 2 * thirds]]
    last = [r for _, r in samples[2 * thirds :]]
    print(f"\n{streams} streams for {duration_s:.0f} s: {tally.completed} answers, {tally.chunks} chunks")
    print(f"errors: {dict(tally.errors) or 'none'}")
    if middle and last:
        print(
            f"ingress RSS: peak {max(r for _, r in samples):.1f} MB; mean of the middle third "
            f"{statistics.mean(middle):.1f} MB, of the last third {statistics.mean(last):.1f} MB "
            f"({statistics.mean(last) / statistics.mean(middle):.3f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--token-ms", type=float, default=1000.0, help="the engine's time per token")
    args = parser.parse_args()
    per_worker = args.streams // 2 + 64
    with dev_stack(POOLS.format(token_ms=args.token_ms, per_worker=per_worker)) as (stack, endpoints):
        pid = stack.process("ingress").popen.pid
        print(f"ingress pid {pid}: {rss_mb(pid):.1f} MB RSS at rest")
        asyncio.run(hold(endpoints, args.streams, args.duration, pid))


if __name__ == "__main__":
    main()
