"""The full pipeline against the same vLLM engine called directly: output tokens/s and time to first token.

Both sides serve SmolLM2-135M-Instruct with the same engine settings (one OpenMP thread, so the engine
holds one core and the other is left to everything else), the same greedy requests and the same
concurrency. Direct: `VllmEngine.generate` in this process, fed the token ids the ingress would send.
Pipeline: the dev stack (HTTP, quota, Kafka, placement, Redis inbox, worker, pub/sub, SSE), read by an
httpx streaming client. Each concurrency level sends `rounds` requests per stream, after one warm-up.
The direct runs come before and after the pipeline run and are averaged, so drift in the machine's
speed during the run does not land on one side; their spread is printed as a noise floor.

vLLM on CPU runs two processes: the engine core (scheduler; it spins, yielding, while it waits for a step)
and the model worker that computes the step. With `--pin`, the model worker runs on core 0 and everything
else (vLLM's engine core and front end, the benchmark client, and in the pipeline run the broker, Redis and
every service) on core 1, so the comparison measures the pipeline's cost rather than its processes taking
CPU from the model; without it, the scheduler places them.

Run: `.venv/bin/python -m bench.vllm_pipeline [--pin]` (SmolLM2 is prepared in .sluice/models on first
use).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.live import dev_stack, stream_chat
from infra.devstack import Endpoints
from infra.models import prepare_smollm2
from plumbing.processes import child_pids

MODEL = "smollm2-135m-instruct"
MODELS = Path(".sluice/models")
MAX_TOKENS = 64

CONFIG = """
[[pools]]
name = "smollm2"
model = "{model}"
engine = "vllm"
context_tokens = 2048
block_size = 128
max_queued = 100000

[pools.vllm]
source = "{source}"
kv_cache_gib = 1.0
max_num_seqs = 32
cpu_threads = 1

[pools.scaling]
min_replicas = 1
max_replicas = 1
"""

Sample = tuple[float, int]  # (seconds to first token, completion tokens) of one request
TOPICS = ["queues", "rivers", "bridges", "gardens", "clocks", "maps", "ships", "trains"]


ENGINE_CORE, OTHER_CORE = 0, 1


def descendants(pid: int) -> list[int]:
    found, todo = [], child_pids(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(child_pids(child))
    return found


def is_model_worker(pid: int) -> bool:
    """vLLM's model worker process, which runs the forward passes (it renames itself VLLM::Worker...)."""
    try:
        return "VLLM::Worker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def pin(pid: int, core: int) -> None:
    """Every thread of the process onto one core."""
    with contextlib.suppress(OSError):  # the process has ended
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # the thread has ended
                os.sched_setaffinity(int(task.name), {core})


def pin_all() -> int:
    """The model worker processes under this one to ENGINE_CORE, the rest (this one included) to OTHER_CORE;
    returns how many model workers were found."""
    engines = 0
    for pid in [os.getpid(), *descendants(os.getpid())]:
        if is_model_worker(pid):
            engines += 1
            pin(pid, ENGINE_CORE)
        else:
            pin(pid, OTHER_CORE)
    return engines


def question(i: int) -> str:
    return f"Write three sentences about {TOPICS[i % len(TOPICS)]} (request {i})."


@dataclass
class Run:
    ttfts: list[float]
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttfts) * 1000


Runs = dict[int, list["Run"]]  # per concurrency level, one run per pass


async def _concurrently(concurrency: int, rounds: int, one: Callable[[int], Awaitable[Sample]]) -> Run:
    """`concurrency` streams, each sending `rounds` requests one after another."""

    async def stream_worker(w: int) -> list[Sample]:
        return [await one(w * rounds + r) for r in range(rounds)]

    t0 = time.perf_counter()
    per_worker = await asyncio.gather(*(stream_worker(w) for w in range(concurrency)))
    seconds = time.perf_counter() - t0
    results = [r for rs in per_worker for r in rs]
    return Run([t for t, _ in results], sum(n for _, n in results), seconds)


async def _passes(
    levels: list[int], rounds: int, repeats: int, one: Callable[[int], Awaitable[Sample]]
) -> Runs:
    """`repeats` passes over the concurrency levels, one level after another in each pass."""
    runs: Runs = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            runs[c].append(await _concurrently(c, rounds, one))
    return runs


async def direct(source: Path, levels: list[int], rounds: int, repeats: int, pinned: bool) -> Runs:
    from gpu_workers.vllm_engine import VllmEngine
    from openai_api.openai_types import ChatMessage
    from openai_api.tokenizer import HFTokenizer
    from plumbing.model_store import ModelStore
    from queue_schemas.config import parse_config
    from queue_schemas.messages import InferenceRequest, SamplingParams

    pool = parse_config(CONFIG.format(model=MODEL, source=source)).pools[0]
    tok = HFTokenizer(source)
    engine = VllmEngine(pool, ModelStore(MODELS), spec_decoding=False)
    await engine.start()
    if pinned and pin_all() != 1:
        raise RuntimeError("expected one vLLM model worker to pin")
    counter = 0

    async def one(i: int) -> Sample:
        nonlocal counter
        counter += 1
        ids = tok.encode_chat([ChatMessage(role="user", content=question(i))])
        request = InferenceRequest(
            request_id=f"bench-{counter:012d}",
            pool="smollm2",
            model=MODEL,
            team="bench",
            prompt_token_ids=tuple(ids),
            sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            created_at=time.time(),
            deadline=time.time() + 600,
        )
        t0 = time.perf_counter()
        ttft = None
        tokens = 0
        async for out in engine.generate(request):
            if out.text and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += out.num_tokens
        return (ttft if ttft is not None else time.perf_counter() - t0), tokens

    try:
        await one(-1)
        return await _passes(levels, rounds, repeats, one)
    finally:
        await engine.close()


async def through_pipeline(endpoints: Endpoints, levels: list[int], rounds: int, repeats: int) -> Runs:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(i: int) -> Sample:
            body = {
                "model": MODEL,
                "stream": True,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": question(i)}],
            }
            t0 = time.perf_counter()
            got = await stream_chat(client, endpoints, body)
            return (got.ttft if got.ttft is not None else time.perf_counter() - t0), got.completion_tokens

        await one(-1)
        return await _passes(levels, rounds, repeats, one)


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """Median [min-max]."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the levels in each setup")
    parser.add_argument(
        "--pin", action="store_true", help="vLLM's model worker on core 0, everything else on core 1"
    )
    parser.add_argument(
        "--fetch-wait-ms",
        type=int,
        default=None,
        help="the services' Kafka fetch wait (default: the dev stack's)",
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = prepare_smollm2(MODELS / MODEL, MODELS / "downloads").resolve()
    env = {} if args.fetch_wait_ms is None else {"SLUICE_KAFKA_FETCH_WAIT_MS": str(args.fetch_wait_ms)}

    if args.pin:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(ENGINE_CORE)  # the model worker's one OpenMP thread
    before = asyncio.run(direct(source, levels, args.rounds, args.repeats, args.pin))
    with dev_stack(CONFIG.format(model=MODEL, source=source), extra_env=env) as (_, endpoints):
        if args.pin and pin_all() != 1:
            raise RuntimeError("expected one vLLM model worker to pin in the stack")
        pipeline_runs = asyncio.run(through_pipeline(endpoints, levels, args.rounds, args.repeats))
    after = asyncio.run(direct(source, levels, args.rounds, args.repeats, args.pin))

    placement = "model worker on core 0, the rest on core 1" if args.pin else "unpinned"
    print(
        f"SmolLM2-135M-Instruct on vLLM (CPU, 1 engine thread, {placement}), {MAX_TOKENS} max tokens, "
        f"greedy; {args.repeats} passes of {args.rounds} requests per stream, median [min-max] over passes"
    )
    print(
        "streams | direct tok/s | pipeline tok/s | ratio of medians [worst-best] | TTFT p50 direct | pipeline"
    )
    for c in levels:
        d, p = before[c] + after[c], pipeline_runs[c]
        d_rate, p_rate = [r.tokens_per_s for r in d], [r.tokens_per_s for r in p]
        ratio = statistics.median(p_rate) / statistics.median(d_rate)
        print(
            f"{c:7d} | {spread(d_rate)} | {spread(p_rate)} | "
            f"{ratio:.2f} [{min(p_rate) / max(d_rate):.2f}-{max(p_rate) / min(d_rate):.2f}] | "
            f"{spread([r.ttft_p50_ms for r in d], '{:.0f}')} ms | "
            f"{spread([r.ttft_p50_ms for r in p], '{:.0f}')} ms"
        )
        if d[0].tokens != p[0].tokens:
            print(f"        note: {d[0].tokens} tokens direct, {p[0].tokens} through the pipeline")


if __name__ == "__main__":
    main()
