"""llm-d's precise-prefix-cache benchmark, reproduced in the simulator as llm-d describes it.

Source: the inference-perf report of llm-d's precise prefix-cache scheduling guide
(llm-d/llm-d, guides/precise-prefix-cache-aware, benchmark report "X-70R-6kSys"):

- 8 vLLM pods of Qwen/Qwen3-32B, tensor parallel over 2 H100 each (16 GPUs); 307,328 tokens of KV per
  pod; vLLM block size 64.
- shared_prefix data: 150 groups, 5 prompts (users) per group, a 6,000-token system prompt per group,
  a 1,200-token question per user, output_len 1,000 (ignore_eos), streamed completions. The report's
  own aggregate figures (8,730 output tokens/s at 35.56 requests/s for precise) imply about 245 tokens
  per request, and 1,000-token answers at 60 QPS would need six times the decode capacity of 8 pods, so
  the requests here ask for 1,000 (`max_tokens`) and produce 245.
- Poisson load in stages: a warm-up of 15 QPS for 50 s, then 3, 10, 15, 20, 22, 25, 30, 35, 40, 43, 46,
  49, 52, 55, 57 and 60 QPS for 20-38 s each (below).
- Schedulers: precise (prefix 3, KV 2, queue 2, KV-event index), estimated (prefix 1, KV 1, queue 1,
  approximate index: an LRU of 31,250 blocks per server of what it routed), load (queue 1, KV 1) and
  random. None configures flow control or a saturation filter.
- sluice's own placement runs the same trace beside them (not in the report).
- Published, across QPS: output tokens/s and TTFT p90 of 8,730 and 0.542 s (precise), 6,944 and 31.1 s
  (estimated), 4,429 and 92.6 s (random), 4,266 and 94.9 s (load).

The replica model is calibrated for Qwen3-32B in BF16 on 2 H100 SXM from public figures only (derived in
docs/benchmarks.md), not fitted to the published outcome.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from bench.sim.engine import Request, TimingModel
from bench.sim.fleet import simulate
from bench.sim.metrics import percentile
from bench.sim.routers import LlmdRouter, RandomRouter, Router, SluiceRouter
from bench.sim.workloads import blocks_of, poisson_times
from dispatcher.placement import PlacementPolicy

BLOCK = 64
SYSTEM, QUESTION, MAX_TOKENS = 6000, 1200, 1000
OUTPUT = 245  # tokens per request implied by the report's own figures (8,730 tokens/s at 35.56 req/s)
GROUPS, USERS = 150, 5
WARMUP = (15.0, 50.0)
LADDER = (
    (3, 20), (10, 20), (15, 20), (20, 38), (22, 34), (25, 30), (30, 25), (35, 21), (40, 38), (43, 36),
    (46, 33), (49, 30), (52, 29), (55, 27), (57, 26), (60, 25),
)  # fmt: skip
PUBLISHED = {  # output tokens/s and TTFT p90 s across QPS, from the report
    "precise": (8730.0, 0.542),
    "estimated": (6944.4, 31.083),
    "load": (4266.4, 94.865),
    "random": (4428.7, 92.551),
}

QWEN3_32B_2XH100 = TimingModel(
    decode_base_s=0.014,  # 65.5 GB of BF16 weights per step over 2 x 3.35 TB/s at ~70%
    decode_per_seq_s=0.00043,  # ~7.7k tokens of context x 256 KiB of KV per token, read once per step
    prefill_per_token_s=0.000082,  # ~73 GFLOP per token (weights + attention at 7k) at 45% of 2 x 989 TF
    chunk_tokens=8192,  # vLLM's max_num_batched_tokens for its API server
    kv_blocks=307_328 // BLOCK,
    block_size=BLOCK,
    max_seqs=256,
)


def stages() -> list[tuple[float, float, float]]:
    """(start, end, rate) of the warm-up and of each ladder stage."""
    out, t = [], 0.0
    for rate, duration in (WARMUP, *LADDER):
        out.append((t, t + duration, float(rate)))
        t += duration
    return out


def requests(rng: random.Random) -> Iterator[Request]:
    spans = stages()
    end = spans[-1][1]

    def rate(t: float) -> float:
        return next((r for a, b, r in spans if a <= t < b), 0.0)

    system_blocks = SYSTEM // BLOCK  # the last partial block holds question tokens too: per user
    own_blocks = (SYSTEM + QUESTION) // BLOCK - system_blocks
    for rid, t in enumerate(poisson_times(rng, rate, 60.0, end)):
        group, user = rng.randrange(GROUPS), rng.randrange(USERS)
        blocks = blocks_of(f"g{group}", 0, system_blocks) + blocks_of(f"g{group}u{user}", 0, own_blocks)
        yield Request(rid, t, blocks, SYSTEM + QUESTION, OUTPUT, tenant=group, max_tokens=MAX_TOKENS)


def make(name: str, seed: int) -> Router:
    rng = random.Random(seed)
    if name == "precise":
        return LlmdRouter(rng, flow_control=False, weights=(3.0, 2.0, 2.0))
    if name == "estimated":
        return LlmdRouter(rng, flow_control=False, weights=(1.0, 1.0, 1.0), approximate_blocks=31_250)
    if name == "load":
        return LlmdRouter(rng, flow_control=False, weights=(0.0, 1.0, 1.0))
    if name == "random":
        return RandomRouter(rng)
    if name == "sluice":
        return SluiceRouter(PlacementPolicy(), rng)
    raise ValueError(name)


def run(name: str, seed: int) -> tuple[float, float, list[tuple[float, float]]]:
    """Output tokens/s and TTFT p90 over the ladder, and (rate, TTFT p90) per stage."""
    done: list[Request] = []
    spans = stages()
    simulate(
        functools.partial(make, name, seed), QWEN3_32B_2XH100, requests, spans[-1][1], 8, seed=seed,
        views="exact", sink=done,
    )  # fmt: skip
    start, end = spans[1][0], spans[-1][1]
    ladder = [r for r in done if start <= r.arrival < end]
    # Tokens of the requests that arrived in the ladder, over the time from its start to their last.
    tokens_per_s = sum(r.output_tokens for r in ladder) / (max(r.done for r in ladder) - start)
    p90 = percentile([r.first_token - r.arrival for r in ladder], 0.9)
    per_stage = []
    for a, b, rate in spans[1:]:
        ttft = [r.first_token - r.arrival for r in ladder if a <= r.arrival < b]
        per_stage.append((rate, percentile(ttft, 0.9)))
    return tokens_per_s, p90, per_stage


def main(seeds: list[int], jobs: int) -> None:
    names = [*PUBLISHED, "sluice"]
    with ProcessPoolExecutor(jobs) as pool:
        futures = {(n, s): pool.submit(run, n, s) for n in names for s in seeds}
        results = {key: f.result() for key, f in futures.items()}
    base_pub = PUBLISHED["precise"][0]
    print(f"\nllm-d precise-prefix benchmark, simulated (seeds {seeds}); published figures beside")
    print(
        "| scheduler | simulated tokens/s | published tokens/s | simulated / precise | published / precise "
        "| simulated TTFT p90 s | published TTFT p90 s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    mean = {n: sum(results[n, s][0] for s in seeds) / len(seeds) for n in names}
    for n in names:
        tps = [results[n, s][0] for s in seeds]
        p90 = [results[n, s][1] for s in seeds]
        pub_tps, pub_p90 = PUBLISHED.get(n, (float("nan"), float("nan")))
        print(
            f"| {n} | {min(tps):,.0f}-{max(tps):,.0f} | {pub_tps:,.0f} | {mean[n] / mean['precise']:.2f} "
            f"| {pub_tps / base_pub:.2f} | {min(p90):.2f}-{max(p90):.2f} | {pub_p90:.2f} |"
        )
    print("\nTTFT p90 s by stage (first seed):")
    print("| QPS | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    stages_by_name = {n: results[n, seeds[0]][2] for n in names}
    for i, (rate, _) in enumerate(stages_by_name[names[0]]):
        print(f"| {rate:g} | " + " | ".join(f"{stages_by_name[n][i][1]:.2f}" for n in names) + " |")
