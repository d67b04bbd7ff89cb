"""Worker kills under steady load: a worker is killed (-9) every N seconds while clients stream answers.

The dev stack runs a simulated pool of three workers (the scaler's local backend replaces each killed
one). Clients keep streamed chat requests open back to back. Before each kill the bench notes which open
streams sit on the victim and have already sent text: those must move to another worker and go on.
At the end it prints the answers completed, the errors (target 0), answers whose text differs from
the simulated engine's deterministic answer (target 0), the dispatchers' migration counts, and what a
migration costs a client: the longest pause inside a moved stream against an unmoved one, and the
time to first token of requests that arrived within five seconds of a kill against the rest.

Run: `.venv/bin/python -m bench.worker_kills [--duration 180] [--every 10] [--clients 8]`. Client,
broker, Redis and every service share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis

from bench.live import dev_stack
from gpu_workers.simulated import answer_to, apply_stops
from infra.devstack import DevStack, Endpoints
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from plumbing.processes import child_pids
from queue_schemas.settings import BusSettings

WORDS = 30
MAX_TOKENS = 400
POOLS = f"""
[[pools]]
name = "sim"
model = "sluice-sim"
default_max_tokens = {MAX_TOKENS}
max_queued = 100000

[pools.simulated]
ttft_ms = 20
token_ms = 15
max_running = 16
min_words = {WORDS}
max_words = {WORDS}

[pools.scaling]
min_replicas = 3
max_replicas = 3
"""


@dataclass
class Stream:
    started: float
    request_id: str = ""
    arrivals: list[float] = field(default_factory=list)  # when each content chunk arrived
    ok: bool = False
    error: str = ""
    wrong_text: bool = False


@dataclass
class Run:
    streams: list[Stream] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    moved: set[str] = field(default_factory=set)


def expected(content: str) -> str:
    prompt = ByteTokenizer().encode_chat([ChatMessage(role="user", content=content)])
    return apply_stops(answer_to(prompt, WORDS, WORDS), MAX_TOKENS, ())[0]


async def one(client: httpx.AsyncClient, endpoints: Endpoints, tag: str, stream: Stream) -> None:
    content = f"kill bench request {tag}"
    body = {"model": "sluice-sim", "stream": True, "messages": [{"role": "user", "content": content}]}
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    text: list[str] = []
    try:
        async with client.stream(
            "POST", endpoints.url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    stream.error = event["error"].get("code") or "error"
                    return
                stream.request_id = event["id"].split("-", 1)[1]
                for choice in event["choices"]:
                    piece = choice["delta"].get("content") or ""
                    if piece:
                        stream.arrivals.append(time.time())
                        text.append(piece)
                    if choice.get("finish_reason"):
                        stream.ok = True
    except httpx.HTTPError as exc:
        stream.error = type(exc).__name__
    stream.wrong_text = stream.ok and "".join(text) != expected(content)


async def client_loop(endpoints: Endpoints, k: int, until: float, run: Run) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5)) as client:
        n = 0
        while time.time() < until:
            stream = Stream(time.time())
            run.streams.append(stream)
            await one(client, endpoints, f"{k}-{n}", stream)
            n += 1


def worker_id_of(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--worker-id") + 1].decode()


async def killer(
    dev: DevStack, redis: aioredis.Redis, bus: BusSettings, every: float, until: float, run: Run
) -> None:
    names = bus.names
    while time.time() + every < until:
        await asyncio.sleep(every)
        victim = random.choice(child_pids(dev.process("scaler").popen.pid))
        worker = worker_id_of(victim)
        open_streams = [s for s in run.streams if s.request_id and not s.ok and not s.error and s.arrivals]
        owners = (
            await redis.mget([names.placement(s.request_id) for s in open_streams]) if open_streams else []
        )
        run.moved |= {s.request_id for s, o in zip(open_streams, owners, strict=True) if o == worker.encode()}
        os.kill(victim, signal.SIGKILL)
        run.kills.append(time.time())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


def longest_pause(s: Stream) -> float:
    return max((b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)), default=0.0)


def main(duration: float, every: float, clients: int) -> None:
    with dev_stack(POOLS) as (dev, endpoints):
        run, migrations = asyncio.run(drive(dev, endpoints, duration, every, clients))
    report(run, migrations, duration, every, clients)


async def drive(
    dev: DevStack, endpoints: Endpoints, duration: float, every: float, clients: int
) -> tuple[Run, dict[str, int]]:
    bus = BusSettings(kafka_bootstrap=endpoints.kafka_bootstrap, redis_url=endpoints.redis_url)
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    run = Run()
    until = time.time() + duration
    try:
        await asyncio.gather(
            killer(dev, redis, bus, every, until, run),
            *(client_loop(endpoints, k, until, run) for k in range(clients)),
        )
        counts = await redis.hgetall(bus.names.migrations("sim"))
    finally:
        await redis.aclose()
    return run, {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in counts.items()}


def report(run: Run, migrations: dict[str, int], duration: float, every: float, clients: int) -> None:
    done = [s for s in run.streams if s.ok]
    errors = [s.error for s in run.streams if s.error]
    moved = [s for s in done if s.request_id in run.moved]
    unmoved = [s for s in done if s.request_id not in run.moved]
    near_kill = [s for s in done if any(0 <= s.started - k <= 5 for k in run.kills) and s.arrivals]
    calm = [s for s in done if s not in near_kill and s.arrivals]
    print(
        f"{duration:.0f} s, {clients} clients, a worker killed every {every:.0f} s ({len(run.kills)} kills)"
    )
    print(f"answers completed: {len(done)}   errors: {len(errors)} {sorted(set(errors))}")
    print(f"answers whose text differs from an uninterrupted run: {sum(s.wrong_text for s in done)}")
    print(f"dispatchers' counts of lost workers' requests: {migrations}")
    print(f"streams on a killed worker mid-answer: {len(run.moved)}, of them completed: {len(moved)}")
    for label, group in (("moved", moved), ("unmoved", unmoved)):
        pauses = [longest_pause(s) for s in group]
        print(
            f"longest pause inside a {label} stream: p50 {pct(pauses, 50):.3f} s  p99 {pct(pauses, 99):.3f} s"
        )
    for label, group in (("within 5 s after a kill", near_kill), ("otherwise", calm)):
        ttfts = [s.arrivals[0] - s.started for s in group]
        print(f"TTFT {label}: p50 {pct(ttfts, 50):.3f} s  p99 {pct(ttfts, 99):.3f} s  (n={len(group)})")
    itl = [
        statistics.mean([b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)] or [0])
        for s in unmoved
    ]
    print(f"mean inter-chunk gap, unmoved streams: {statistics.mean(itl) if itl else float('nan'):.4f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    main(args.duration, args.every, args.clients)
