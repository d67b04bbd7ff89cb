"""What one piece of the control plane carries: the figures docs/scale.md sizes a fleet from.

`bus`: stream chunks through Redis pub/sub, one Valkey server against a three-primary Redis Cluster,
measured in one run. Publisher processes write chunks the way workers do (each chunk's log write,
expiry, publish and placement read, `chunk_commands`, pipelined by `PipelinedPublisher`, sharded
publish on the cluster) to channels of random request ids;
one subscriber process holds every channel through the ingress's `StreamHub` and counts what arrives.
Two cores cannot load a Valkey shard to its limit from Python clients, so the figure per shard is the
server's own CPU per chunk (`INFO cpu` before and after, summed over the shards): a shard is one
thread, so one core carries 1 / (CPU per chunk) chunks a second.

`relay`: the dev stack with a fast simulated pool. N clients keep a streamed answer open at all times;
the ingress's and the dispatchers' CPU time (from /proc) over the measured window give chunks relayed
per ingress core-second and placements per dispatcher core-second, and the ingress's resident memory
with N streams open against at rest gives its memory per open stream.

Run: `.venv/bin/python -m bench.control_plane bus` and `.venv/bin/python -m bench.control_plane relay`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.live import dev_stack, stream_chat
from infra.devstack import Endpoints
from infra.launcher import (
    LocalCluster,
    ManagedProcess,
    free_ports,
    node_command,
    start_redis,
    start_redis_cluster,
)
from ingress.streams import StreamHub, Subscription
from plumbing.clients import node_client, redis_client
from plumbing.protocol.request import chunk_commands
from plumbing.publisher import PipelinedPublisher
from plumbing.replay import MOVES_FIELD
from queue_schemas.codec import decode_stream_event
from queue_schemas.messages import FinalChunk, TokenChunk
from queue_schemas.settings import BusSettings

CHUNK_TEXT = "word " * 4  # a coalesced chunk of a few tokens, as workers send under load
HUB_WARMUP_S = 2.0
REST_S = 5.0


# bus
def _publish(
    settings: BusSettings, channels: list[str], seconds: float, tasks: int, rate: float, out: Any
) -> None:
    """One publisher process: `tasks` concurrent writers, each sending chunks to its share of channels,
    `rate` chunks a second in all (a round over its channels every len(channels) / rate seconds)."""
    interval = len(channels) / rate

    async def run() -> int:
        redis = redis_client(settings)
        publisher = PipelinedPublisher(redis)
        names = settings.names
        sent = 0
        stop = time.monotonic() + seconds

        async def writer(mine: list[str]) -> None:
            nonlocal sent
            seq = 0
            start = time.monotonic()
            while time.monotonic() < stop:
                for rid in mine:
                    chunk = TokenChunk(
                        request_id=rid, seq=seq, text=CHUNK_TEXT, num_tokens=4, token_ids=(1, 2, 3, 4)
                    )
                    payload = chunk.model_dump_json().encode()
                    # As a worker writes: logged, published, and its placement read back.
                    command = settings.stream_publish
                    await publisher.run(chunk_commands(names, chunk, payload, 0, 60_000, command))
                    sent += 1
                seq += 1
                # Each channel gets one chunk per round: a round takes len(channels) / rate seconds.
                await asyncio.sleep(max(0.0, start + seq * interval - time.monotonic()))

        await asyncio.gather(*(writer(channels[i::tasks]) for i in range(tasks)))
        await publisher.close()
        await redis.aclose()
        return sent

    out.put(asyncio.run(run()))


def _subscribe(settings: BusSettings, channels: list[str], seconds: float, ready: Any, out: Any) -> None:
    """The subscriber process: every channel through one StreamHub, counting chunks received."""

    async def run() -> int:
        redis = redis_client(settings, retry=False)
        names = settings.names
        hub = StreamHub(redis, names.ingress_control_channel(), node_client=partial(node_client, settings))
        await hub.start()
        await hub.wait_ready(30)
        subs = [await hub.subscribe(names.stream_channel(rid)) for rid in channels]
        ready.set()
        received = 0
        stop = time.monotonic() + seconds * 4 / 3 + HUB_WARMUP_S  # the servers' rest third, then the load

        async def drain(sub: Subscription) -> None:
            nonlocal received
            while time.monotonic() < stop:
                try:
                    await sub.next(time.time() + 0.5)
                    received += 1
                except TimeoutError:
                    continue

        await asyncio.gather(*(drain(s) for s in subs))
        await hub.close()
        await redis.aclose()
        return received

    out.put(asyncio.run(run()))


def server_info(ports: list[int], section: str, fields: tuple[str, ...]) -> float:
    """The sum of INFO `fields` over the servers on `ports`."""
    total = 0.0
    for port in ports:
        for line in node_command(port, "INFO", section).splitlines():
            if line.startswith(tuple(f + ":" for f in fields)):
                total += float(line.split(":")[1])
    return total


def command_usec(port: int) -> dict[str, float]:
    """Microseconds each command has taken on the server on `port` since its last CONFIG RESETSTAT."""
    spent: dict[str, float] = {}
    for line in node_command(port, "INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, stats = line.removeprefix("cmdstat_").split(":", 1)
            fields = dict(item.split("=") for item in stats.split(","))
            spent[name] = float(fields["usec"])
    return spent


def server_cpu_s(ports: list[int]) -> float:
    """used_cpu_user + used_cpu_sys of the servers on `ports`, summed (seconds)."""
    return server_info(ports, "cpu", ("used_cpu_user", "used_cpu_sys"))


def bus_run(
    settings: BusSettings,
    ports: list[int],
    channels: int,
    seconds: float,
    procs: int,
    tasks: int,
    rate: float,
) -> dict[str, float]:
    rids = [secrets.token_hex(16) for _ in range(channels)]
    ctx = multiprocessing.get_context("spawn")
    out, got = ctx.Queue(), ctx.Queue()
    ready = ctx.Event()
    sub = ctx.Process(target=_subscribe, args=(settings, rids, seconds, ready, got))
    sub.start()
    if not ready.wait(120):
        raise RuntimeError("subscriber did not come up")
    idle0 = server_cpu_s(ports)
    time.sleep(seconds / 3)  # the servers' own cost at rest (cron, the cluster bus), taken out below
    idle = (server_cpu_s(ports) - idle0) * 3 / seconds
    cpu0 = server_cpu_s(ports)
    memory0 = server_info(ports, "memory", ("used_memory",))
    t0 = time.monotonic()
    pubs = [
        ctx.Process(target=_publish, args=(settings, rids[i::procs], seconds, tasks, rate / procs, out))
        for i in range(procs)
    ]
    for p in pubs:
        p.start()
    for p in pubs:
        p.join()
    elapsed = time.monotonic() - t0
    cpu = server_cpu_s(ports) - cpu0 - idle * elapsed
    memory = server_info(ports, "memory", ("used_memory",)) - memory0  # the logs keep every chunk
    sent = sum(out.get() for _ in range(procs))
    received = got.get()
    sub.join()
    return {
        "sent": sent,
        "received": received,
        "seconds": elapsed,
        "server_cpu_s": cpu,
        "idle_cores": idle,
        "memory_bytes": memory,
    }


def bus(args: argparse.Namespace) -> None:
    print(
        f"{args.channels} channels, {args.publishers} publisher processes x {args.tasks} writers offering "
        f"{args.rate:,.0f} chunks/s, {args.seconds:.0f} s per mode\n"
    )
    print(
        "| mode | shards | chunks sent/s | received/s | server CPU per chunk | chunks/s per shard core "
        "| servers at rest | Redis memory per logged chunk |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for mode, shards in (("single", 1), ("cluster", 3)):
            log_dir = Path(tmp) / mode
            procs: list[ManagedProcess] = []
            cluster: LocalCluster | None = None
            if mode == "single":
                (port,) = free_ports(1)
                procs.append(start_redis(port, log_dir))
                ports = [port]
            else:
                ports = free_ports(shards)
                cluster = start_redis_cluster(ports, log_dir)
            settings = BusSettings(
                redis_url=f"redis://127.0.0.1:{ports[0]}/0", redis_cluster=mode == "cluster", prefix="bench"
            )
            try:
                r = bus_run(
                    settings, ports, args.channels, args.seconds, args.publishers, args.tasks, args.rate
                )
            finally:
                for proc in procs:
                    proc.stop()
                if cluster is not None:
                    cluster.stop()
            per_chunk_us = r["server_cpu_s"] / max(1, r["sent"]) * 1e6
            per_shard = 1e6 / per_chunk_us if per_chunk_us else 0.0
            sent, received = r["sent"] / r["seconds"], r["received"] / r["seconds"]
            row = [
                mode,
                shards,
                f"{sent:,.0f}",
                f"{received:,.0f}",
                f"{per_chunk_us:.1f} us",
                f"{per_shard:,.0f}",
                f"{r['idle_cores'] * 100:.1f}% of a core",
                f"{r['memory_bytes'] / max(1, r['sent']):.0f} B",
            ]
            print("| " + " | ".join(map(str, row)) + " |")


# relay
RELAY_POOLS = """
[[pools]]
name = "fast"
model = "sluice-fast"
default_max_tokens = 400
max_queued = 100000
partitions = 4
[pools.simulated]
ttft_ms = 5
token_ms = {token_ms}
max_running = 512
kv_blocks = 65536
min_words = 60
max_words = 80
[pools.scaling]
min_replicas = 2
max_replicas = 2
"""


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def keep_streams(
    endpoints: Endpoints, streams: int, stop_at: float, tally: dict[str, int], max_tokens: int | None
) -> None:
    """`streams` clients, each starting its next streamed answer when one ends, until `stop_at`. Chunks
    are counted as they arrive (`live_chunks`); answers, their chunks and tokens as they end."""
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=streams + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        def on_chunk() -> None:
            tally["live_chunks"] += 1

        async def one(n: int) -> None:
            body: dict[str, object] = {
                "model": "sluice-fast",
                "messages": [{"role": "user", "content": f"stream {n} {secrets.token_hex(4)}"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            while time.monotonic() < stop_at:
                try:
                    done = await stream_chat(client, endpoints, body, on_chunk)
                    tally["answers"] += 1
                    tally["chunks"] += done.chunks
                    tally["tokens"] += done.completion_tokens
                except (RuntimeError, httpx.HTTPError):
                    tally["errors"] += 1

        await asyncio.gather(*(one(n) for n in range(streams)))


def measure_window(
    endpoints: Endpoints,
    pids: dict[str, int],
    streams: int,
    max_tokens: int | None,
    warmup: float,
    seconds: float,
) -> dict[str, float]:
    """Hold `streams` clients busy; over `seconds` after `warmup`: answers, chunks, errors, CPU seconds of
    each process in `pids`, and the ingress's resident memory at the end; chunks also as they arrived
    (`live_chunks`), and chunks and tokens of every answer of the run (`run_*`)."""
    tally = {"answers": 0, "chunks": 0, "tokens": 0, "errors": 0, "live_chunks": 0}
    out: dict[str, float] = {}
    redis_port = int(endpoints.redis_url.rsplit(":", 1)[1].split("/")[0])

    async def run() -> None:
        stop_at = time.monotonic() + warmup + seconds
        load = asyncio.create_task(keep_streams(endpoints, streams, stop_at, tally, max_tokens))
        await asyncio.sleep(warmup)
        before = {name: proc_cpu_s(pid) for name, pid in pids.items()}
        node_command(redis_port, "CONFIG", "RESETSTAT")
        counts = dict(tally)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        span = time.monotonic() - t0
        for name, pid in pids.items():
            out[f"{name}_cpu"] = proc_cpu_s(pid) - before[name]
        out.update({key: tally[key] - counts[key] for key in tally}, span=span)
        out.update({f"usec_{name}": usec for name, usec in command_usec(redis_port).items()})
        out["rss"] = proc_rss_mb(pids["ingress"])
        out["log_bytes_per_token"] = await log_bytes_per_token(endpoints.redis_url)
        await load  # the answers open at the window's end run to their end: their sizes count below
        out.update(run_tokens=tally["tokens"], run_chunks=tally["chunks"])

    asyncio.run(run())
    return out


async def log_bytes_per_token(url: str, sample: int = 200) -> float:
    """Redis memory of replay logs (`MEMORY USAGE`) over the tokens they hold, over up to `sample` logs
    of requests that have ended."""
    redis = aioredis.Redis.from_url(url)
    used = tokens = 0
    try:
        async for key in redis.scan_iter(match="*:replay:*", count=500):
            fields = await redis.hgetall(key)
            chunks = [
                decode_stream_event(raw) for name, raw in fields.items() if name != MOVES_FIELD.encode()
            ]
            if not any(isinstance(c, FinalChunk) for c in chunks):
                continue
            used += await redis.memory_usage(key) or 0
            tokens += sum(c.num_tokens for c in chunks if isinstance(c, TokenChunk | FinalChunk))
            sample -= 1
            if not sample:
                break
    finally:
        await redis.aclose()
    return used / max(1, tokens)


def relay(args: argparse.Namespace) -> None:
    with dev_stack(RELAY_POOLS.format(token_ms=args.token_ms), dispatchers=1) as (stack, endpoints):
        pids = {
            "ingress": stack.process("ingress").popen.pid,
            "dispatcher": stack.process("dispatcher-fast").popen.pid,
            "redis": stack.process("redis").popen.pid,
        }
        rest_rss = proc_rss_mb(pids["ingress"])
        before, t0 = proc_cpu_s(pids["redis"]), time.monotonic()
        time.sleep(REST_S)  # Redis's own work with nothing asked of it: heartbeats, loops polling
        redis_rest = (proc_cpu_s(pids["redis"]) - before) / (time.monotonic() - t0)
        long = measure_window(endpoints, pids, args.streams, None, args.warmup, args.seconds)
        short = measure_window(endpoints, pids, args.short_clients, 1, args.warmup / 2, args.seconds)
    # Short answers: the ingress's cost per request (with its one or two chunks) and the dispatcher's
    # per placement. Long answers: what is left of the ingress's CPU after their requests, per chunk.
    per_request = short["ingress_cpu"] / max(1, short["answers"])
    per_placement = short["dispatcher_cpu"] / max(1, short["answers"])
    # Chunks as they arrived within the window; tokens at the chunk size of every answer of the run (an
    # answer longer than the window would otherwise count only if it ended inside it).
    chunks = long["live_chunks"]
    per_chunk_tokens = long["run_tokens"] / max(1, long["run_chunks"])
    tokens = max(1.0, chunks * per_chunk_tokens)
    chunk_cpu = max(1e-9, long["ingress_cpu"] - per_request * long["answers"])
    per_chunk = chunk_cpu / max(1, chunks)
    print(f"long answers: {args.streams} streams held open, {long['span']:.0f} s measured")
    span = long["span"]
    print(f"  chunks relayed {chunks / span:,.0f}/s, answers {long['answers'] / span:.1f}/s, "
          f"errors {long['errors']:.0f}; ingress {long['ingress_cpu'] / span:.2f} cores")  # fmt: skip
    redis_work = max(0.0, long["redis_cpu"] - redis_rest * span)
    print(f"  tokens {tokens / span:,.0f}/s ({per_chunk_tokens:.1f} a chunk); Redis "
          f"{long['redis_cpu'] / span:.3f} cores ({redis_rest:.3f} at rest): "
          f"{redis_work * 1e6 / tokens:.2f} CPU-us per token delivered beyond rest "
          f"({long['redis_cpu'] * 1e6 / tokens:.2f} with it)")  # fmt: skip
    spent = sorted(((k.removeprefix("usec_"), v) for k, v in long.items() if k.startswith("usec_")),
                   key=lambda kv: -kv[1])  # fmt: skip
    print("  Redis command time per token delivered (us): "
          + ", ".join(f"{name} {usec / tokens:.2f}" for name, usec in spent[:6]))  # fmt: skip
    print(f"  replay logs: {long['log_bytes_per_token']:.1f} B of Redis memory per token")
    print(f"  per ingress core-second (all of its work, requests included): "
          f"{chunks / max(1e-9, long['ingress_cpu']):,.0f} chunks, "
          f"{tokens / max(1e-9, long['ingress_cpu']):,.0f} tokens")  # fmt: skip
    print(f"  ingress RSS {rest_rss:.1f} MB at rest, {long['rss']:.1f} MB with {args.streams} streams open: "
          f"{(long['rss'] - rest_rss) * 1024 / args.streams:.0f} KB per open stream")  # fmt: skip
    print(f"short answers (max_tokens 1): {args.short_clients} clients back to back, {short['span']:.0f} s")
    print(f"  requests {short['answers'] / short['span']:.1f}/s, errors {short['errors']:.0f}; ingress "
          f"{short['ingress_cpu'] / short['span']:.2f} cores, dispatcher "
          f"{short['dispatcher_cpu'] / short['span']:.2f} cores")  # fmt: skip
    print(
        f"per ingress core-second: {1 / per_request:,.0f} requests admitted, or {1 / per_chunk:,.0f} chunks"
    )
    print(f"per dispatcher core-second: {1 / per_placement:,.0f} placements")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="part", required=True)
    b = sub.add_parser("bus", help="pub/sub chunks per shard: one server against a three-primary cluster")
    b.add_argument("--channels", type=int, default=2000)
    b.add_argument("--seconds", type=float, default=15.0)
    b.add_argument("--publishers", type=int, default=2)
    b.add_argument("--tasks", type=int, default=64)
    b.add_argument("--rate", type=float, default=10_000, help="chunks per second offered, in all")
    r = sub.add_parser("relay", help="chunks per ingress core, placements per dispatcher core")
    r.add_argument("--streams", type=int, default=200)
    r.add_argument("--token-ms", type=int, default=20)
    r.add_argument("--seconds", type=float, default=30.0)
    r.add_argument("--warmup", type=float, default=10.0)
    r.add_argument("--short-clients", type=int, default=32)
    args = parser.parse_args()
    parts: dict[str, Callable[[argparse.Namespace], None]] = {"bus": bus, "relay": relay}
    parts[args.part](args)


if __name__ == "__main__":
    main()
