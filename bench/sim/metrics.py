"""What a simulated run measured: latency percentiles, throughput, prefix-cache hits, SLOs, cost."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from bench.sim.engine import Request
from bench.sim.fleet import Outcome

GPUS_PER_REPLICA = 4


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Summary:
    requests: int
    finished: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float
    itl_p90: float
    itl_p99: float
    tokens_per_s: float
    hit_rate: float
    slo_attainment: float
    gpu_hours: float


def summarize(
    outcome: Outcome,
    ttft_slo_s: float = 2.0,
    itl_slo_s: float = 0.1,
    priority: str = "interactive",
) -> Summary:
    done = [r for r in outcome.requests if r.priority == priority]
    ttft = [r.first_token - r.arrival for r in done]
    itl = [(r.done - r.first_token) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    end = max((r.done for r in outcome.requests), default=1.0)
    tokens = sum(r.output_tokens for r in outcome.requests)
    prompt = sum(r.prompt_tokens for r in done) or 1
    good = sum(
        1
        for r in done
        if r.first_token - r.arrival <= ttft_slo_s
        and (r.output_tokens <= 1 or (r.done - r.first_token) / (r.output_tokens - 1) <= itl_slo_s)
    )
    total = len(done) + outcome.unfinished if priority == "interactive" else len(done)
    return Summary(
        requests=total,
        finished=len(done),
        ttft_p50=percentile(ttft, 0.5),
        ttft_p90=percentile(ttft, 0.9),
        ttft_p99=percentile(ttft, 0.99),
        itl_p50=percentile(itl, 0.5),
        itl_p90=percentile(itl, 0.9),
        itl_p99=percentile(itl, 0.99),
        tokens_per_s=tokens / end,
        hit_rate=sum(r.cached_tokens for r in done) / prompt,
        slo_attainment=good / max(1, total),
        gpu_hours=outcome.replica_seconds * GPUS_PER_REPLICA / 3600,
    )


def violation_minutes(requests: list[Request], duration_s: float, ttft_slo_s: float, unfinished: int) -> int:
    """Minutes whose arrivals had a p90 time to first token over the SLO (unstarted ones count as over)."""
    by_minute: dict[int, list[float]] = defaultdict(list)
    for r in requests:
        if r.priority == "interactive":
            by_minute[int(r.arrival // 60)].append(r.first_token - r.arrival)
    bad = sum(1 for m, v in by_minute.items() if m * 60 < duration_s and percentile(v, 0.9) > ttft_slo_s)
    return bad + (1 if unfinished else 0)
