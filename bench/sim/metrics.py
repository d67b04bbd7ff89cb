"""What a simulated run measured: latency percentiles, throughput, prefix-cache hits, SLOs, cost.

Finished requests are folded into `Stats` as they finish, so a run's memory does not grow with its
length: latencies go into `Sketch`es (log-spaced buckets, 0.5% relative error) instead of lists.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.sim.engine import Request

if TYPE_CHECKING:
    from bench.sim.fleet import Outcome

GPUS_PER_REPLICA = 4
TTFT_SLO_S = 2.0
ITL_SLO_S = 0.1


class Sketch:
    """A streaming quantile sketch: counts per log-spaced bucket, each `accuracy` wide in relative terms.

    A quantile is answered with the midpoint of its bucket, within `accuracy` of the exact value (the
    scheme of DDSketch). Zero and negative values share one bucket and are answered as 0.
    """

    def __init__(self, accuracy: float = 0.005) -> None:
        self.gamma = (1 + accuracy) / (1 - accuracy)
        self._log_gamma = math.log(self.gamma)
        self.buckets: Counter[int] = Counter()
        self.zeros = 0
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        if value <= 0:
            self.zeros += 1
        else:
            self.buckets[math.ceil(math.log(value) / self._log_gamma)] += 1

    def quantile(self, q: float) -> float:
        """The value at rank int(q x count) of the sorted values (as `percentile` ranks); nan if empty."""
        if not self.count:
            return math.nan
        rank = min(self.count - 1, int(q * self.count))
        if rank < self.zeros:
            return 0.0
        seen = self.zeros
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen > rank:
                return 2 * self.gamma**key / (self.gamma + 1)
        raise AssertionError("rank beyond the count")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ClassStats:
    """Finished requests of one priority class."""

    finished: int = 0
    good: int = 0  # met both the TTFT and the inter-token SLO
    cold: int = 0  # found none of their prompt cached where they ran
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: Sketch = field(default_factory=Sketch)
    itl: Sketch = field(default_factory=Sketch)


@dataclass
class Stats:
    by_class: dict[str, ClassStats] = field(default_factory=lambda: defaultdict(ClassStats))
    output_tokens: int = 0
    last_done: float = 0.0
    minutes: dict[int, Sketch] | None = None  # interactive TTFT by minute of arrival, when asked for
    split_at: float | None = None  # when set: interactive TTFT of arrivals before it and from it on
    before: Sketch = field(default_factory=Sketch)
    after: Sketch = field(default_factory=Sketch)
    preemptions: int = 0
    adapter_loads: int = 0

    def add(self, r: Request) -> None:
        self.preemptions += r.preempted
        self.adapter_loads += r.adapter_loads
        c = self.by_class[r.priority]
        c.finished += 1
        ttft = r.first_token - r.arrival
        c.ttft.add(ttft)
        itl = (r.done - r.first_token) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            c.itl.add(itl)
        c.good += ttft <= TTFT_SLO_S and itl <= ITL_SLO_S
        c.cold += r.cached_tokens == 0
        c.prompt_tokens += r.prompt_tokens
        c.cached_tokens += r.cached_tokens
        self.output_tokens += r.output_tokens
        self.last_done = max(self.last_done, r.done)
        if self.minutes is not None and r.priority == "interactive":
            self.minutes.setdefault(int(r.arrival // 60), Sketch()).add(ttft)
        if self.split_at is not None and r.priority == "interactive":
            (self.before if r.arrival < self.split_at else self.after).add(ttft)


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
    cold: int


def summarize(outcome: Outcome, priority: str = "interactive") -> Summary:
    stats = outcome.stats
    c = stats.by_class.get(priority, ClassStats())
    total = c.finished + outcome.unfinished if priority == "interactive" else c.finished
    return Summary(
        requests=total,
        finished=c.finished,
        ttft_p50=c.ttft.quantile(0.5),
        ttft_p90=c.ttft.quantile(0.9),
        ttft_p99=c.ttft.quantile(0.99),
        itl_p50=c.itl.quantile(0.5),
        itl_p90=c.itl.quantile(0.9),
        itl_p99=c.itl.quantile(0.99),
        tokens_per_s=stats.output_tokens / (stats.last_done or 1.0),
        hit_rate=c.cached_tokens / (c.prompt_tokens or 1),
        slo_attainment=c.good / max(1, total),
        gpu_hours=outcome.replica_seconds * GPUS_PER_REPLICA / 3600,
        cold=c.cold,
    )


def violation_minutes(stats: Stats, duration_s: float, ttft_slo_s: float, unfinished: int) -> int:
    """Minutes whose arrivals had a p90 time to first token over the SLO (unstarted ones count as over)."""
    assert stats.minutes is not None, "the run was not asked to keep TTFT by minute"
    bad = sum(1 for m, s in stats.minutes.items() if m * 60 < duration_s and s.quantile(0.9) > ttft_slo_s)
    return bad + (1 if unfinished else 0)
