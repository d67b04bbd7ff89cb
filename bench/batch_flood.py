"""Interactive time to first token with and without a batch flood beside it, in one run of the dev stack.

Phase 1: N interactive clients stream chat replies through ingress, back to back.
Phase 2: batch submissions are produced to batch.<pool> with a plain Kafka producer, and the same
interactive load runs again while the dispatcher works through them.

Engines (`--engine`):
- `sim`: the simulated engine, 2 workers of 16 slots, 20 ms to the first token and 10 ms per token after
  it; 10,000 batch submissions of 16 tokens.
- `vllm`: SmolLM2-135M-Instruct on vLLM (CPU), one worker of 8 slots, greedy; 300 batch submissions of
  64 tokens. With `--pin` vLLM's model worker runs alone on core 0 and everything else on core 1 (as
  bench/vllm_pipeline.py does).

`--scheduling` sets the engine's scheduling (`priority`, the default: interactive requests go ahead of
batch requests inside the engine, and preempt them when KV blocks run out; `fcfs`: arrival order).
`--headroom` is the share of each worker's slots and KV blocks batch placement leaves to interactive
requests (batch_headroom_fraction of dispatchers and workers, 0.25 by default). `--light-slots` sets the
pool's light slots (2 by default; they serve interactive requests of teams under their share, and
here the interactive and batch requests are one team's).

Printed: p50/p90/p99 TTFT of both phases and their ratio, the batch answers delivered during phase 2 and
their tokens per second (what batch gets from the room interactive load leaves), and the engine's
preemptions (from the workers' heartbeats).

Run: `.venv/bin/python -m bench.batch_flood [--engine vllm --pin]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.live import dev_stack
from bench.pipeline_latency import percentile, run_many
from bench.vllm_pipeline import ENGINE_CORE, MODEL, MODELS, pin_all
from infra.devstack import DevStack, Endpoints
from infra.models import prepare_smollm2
from queue_schemas.messages import Heartbeat
from queue_schemas.names import Names
from queue_schemas.signing import load_private_key, sign_record

SIM = """
[[pools]]
name = "flood"
model = "sluice-sim"
max_queued = 100000
light_slots = {light}

[pools.simulated]
ttft_ms = 20
token_ms = 10
max_running = 16
scheduling = "{scheduling}"

[pools.scaling]
min_replicas = 2
max_replicas = 2
"""
VLLM = """
[[pools]]
name = "flood"
model = "{model}"
engine = "vllm"
context_tokens = 2048
block_size = 128
max_queued = 100000
light_slots = {light}

[pools.vllm]
source = "{source}"
kv_cache_gib = 1.0
max_num_seqs = 8
cpu_threads = 1
scheduling_policy = "{scheduling}"

[pools.scaling]
min_replicas = 1
max_replicas = 1
"""
TEAM = "dev"
POOL = "flood"


def summary(label: str, ttfts: list[float]) -> tuple[float, float]:
    ms = [t * 1000 for t in ttfts]
    p50, p90, p99 = statistics.median(ms), percentile(ms, 0.9), percentile(ms, 0.99)
    print(f"  {label:<28} {len(ms):>5} requests  TTFT ms  p50 {p50:6.1f}  p90 {p90:6.1f}  p99 {p99:6.1f}")
    return p50, p99


async def flood(stack: DevStack, endpoints: Endpoints, model: str, count: int, max_tokens: int) -> float:
    """Produce `count` batch submissions, signed with the dev team's key; returns the seconds it took."""
    signer = load_private_key(stack.signing_key_file.read_text())
    producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap, linger_ms=5)
    await producer.start()
    t0 = time.perf_counter()
    try:
        sends = []
        for i in range(count):
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"batch item {i}: summarise the queue"}],
            }
            sub = {"v": 1, "request_id": f"flood-{i}", "custom_id": f"f{i}", "team": TEAM, "body": body}
            value = json.dumps(sub).encode()
            topic = f"{stack.prefix}.batch.{POOL}"
            sends.append(await producer.send(topic, value, headers=sign_record(signer, value)))
        await asyncio.gather(*sends)
    finally:
        await producer.stop()
    return time.perf_counter() - t0


async def count_answers(endpoints: Endpoints, prefix: str, counts: list[int], stop: asyncio.Event) -> None:
    """Count answers, completed ones, and their completion tokens on the team's results topic into
    `counts` until `stop`."""
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
                for record in records:
                    answer = json.loads(record.value or b"{}")
                    counts[0] += 1
                    response = answer.get("response") or {}
                    if response.get("status_code") == 200:
                        counts[1] += 1
                        counts[2] += response["body"]["usage"]["completion_tokens"]
    finally:
        await consumer.stop()


async def preemptions(endpoints: Endpoints, prefix: str) -> int:
    """The pool's engine preemptions so far, summed over its workers' latest heartbeats."""
    names = Names(prefix=prefix)
    redis = aioredis.from_url(endpoints.redis_url)
    try:
        workers = [
            w.decode() if isinstance(w, bytes) else w for w in await redis.smembers(names.workers(POOL))
        ]
        raw = await redis.mget([names.heartbeat(POOL, w) for w in workers]) if workers else []
        return sum(Heartbeat.model_validate_json(r).preemptions for r in raw if r is not None)
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--scheduling", choices=["priority", "fcfs"], default="priority")
    parser.add_argument("--headroom", type=float, default=None, help="batch_headroom_fraction (default 0.25)")
    parser.add_argument(
        "--light-slots", type=int, default=2, help="light slots per worker (the pool default)"
    )
    parser.add_argument("--pin", action="store_true", help="vllm: the model worker alone on core 0")
    parser.add_argument("--streams", type=int, default=None, help="interactive clients (sim 8, vllm 2)")
    parser.add_argument("--requests", type=int, default=None, help="per phase (sim 600, vllm 60)")
    parser.add_argument("--tokens", type=int, default=30, help="interactive reply length")
    parser.add_argument("--batch", type=int, default=None, help="batch submissions (sim 10,000, vllm 300)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="batch reply length (sim 16, vllm 64)")
    args = parser.parse_args()
    vllm = args.engine == "vllm"
    streams = args.streams or (2 if vllm else 8)
    requests = args.requests or (60 if vllm else 600)
    batch = args.batch or (300 if vllm else 10_000)
    batch_tokens = args.batch_tokens or (64 if vllm else 16)
    env = {} if args.headroom is None else {"SLUICE_BATCH_HEADROOM_FRACTION": str(args.headroom)}
    if vllm:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        source = prepare_smollm2(MODELS / MODEL, MODELS / "downloads").resolve()
        config, model = (
            VLLM.format(model=MODEL, source=source, scheduling=args.scheduling, light=args.light_slots),
            MODEL,
        )
        if args.pin:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(ENGINE_CORE)
    else:
        config, model = SIM.format(scheduling=args.scheduling, light=args.light_slots), "sluice-sim"
    with dev_stack(config, extra_env=env) as (stack, endpoints):
        if vllm and args.pin and pin_all() != 1:
            raise RuntimeError("expected one vLLM model worker to pin")
        shape = "1 worker x 8 slots, SmolLM2 on vLLM (CPU)" if vllm else "2 workers x 16 slots, simulated"
        headroom = 0.25 if args.headroom is None else args.headroom
        print(
            f"{streams} interactive streams of {args.tokens} tokens; {shape}; {args.scheduling} scheduling; "
            f"batch headroom {headroom:g}; {batch} batch submissions of {batch_tokens} tokens"
        )
        quiet, _ = asyncio.run(run_many(endpoints, model, streams, requests, args.tokens))
        _, q99 = summary("alone", [t for t, *_ in quiet])
        before = asyncio.run(preemptions(endpoints, stack.prefix))
        counts = [0, 0, 0]

        async def flooded() -> tuple[list[float], float, float]:
            stop = asyncio.Event()
            counter = asyncio.create_task(count_answers(endpoints, stack.prefix, counts, stop))
            producing = asyncio.create_task(flood(stack, endpoints, model, batch, batch_tokens))
            await asyncio.sleep(1.0)  # the dispatcher is taking the flood in
            t0 = time.perf_counter()
            results, _ = await run_many(endpoints, model, streams, requests, args.tokens)
            phase_s = time.perf_counter() - t0
            stop.set()
            await counter
            return [t for t, *_ in results], await producing, phase_s

        ttfts, produce_s, phase_s = asyncio.run(flooded())
        _, f99 = summary(f"beside {batch} batch", ttfts)
        answered, ok, tokens = counts
        if not ok:
            raise RuntimeError("no batch answer came back: the flood was not served (see the stack's logs)")
        preempted = asyncio.run(preemptions(endpoints, stack.prefix)) - before
        print(f"  p99 ratio {f99 / q99:4.2f}   (target: <= 1.2)")
        print(
            f"  flood produced in {produce_s:.1f} s; {answered} batch answers ({ok} completed, {tokens} "
            f"tokens, {tokens / phase_s:.1f} tokens/s) by the end of the {phase_s:.1f} s interactive phase; "
            f"{preempted} preemptions"
        )


if __name__ == "__main__":
    main()
