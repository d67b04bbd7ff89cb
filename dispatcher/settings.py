from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dispatcher.placement import PlacementPolicy
from dispatcher.scorers import default_weights, weights_problem
from plumbing.latency import LatencyDefaults
from queue_schemas.config import LatencyConfig
from queue_schemas.settings import BusSettings


class DispatcherSettings(BusSettings):
    pool: str = Field(default="sim", description="the pool whose requests topic this dispatcher consumes")
    view_refresh_s: float = Field(default=0.25, gt=0, description="how often worker heartbeats are re-read")
    hold_poll_s: float = Field(default=0.02, gt=0, description="retry interval while requests are held")
    hold_capacity: int = Field(default=1000, gt=0, description="requests held before partitions are paused")
    batch_hold_capacity: int = Field(
        default=256, gt=0, description="batch requests held before the batch partitions are paused"
    )
    batch_per_round: int = Field(
        default=8, gt=0, description="batch requests tried per placement round, between receives"
    )
    weights_refresh_s: float = Field(default=5.0, gt=0, description="how often team weights are re-read")
    fetch_max_records: int = Field(default=256, gt=0)
    max_misses_per_round: int = Field(
        default=16, gt=0, description="held requests tried per round if none fit"
    )
    recovery_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="after Redis fails to answer, how long before a missing heartbeat means a lost worker",
    )
    lease_ms: int = Field(
        default=1000,
        ge=200,
        description="a partition lease lapses this long after its dispatcher stops renewing it",
    )
    placement_ttl_s: int = Field(default=24 * 3600, gt=0, description="how long a placement record is kept")
    inbox_max_len: int = Field(default=100_000, gt=0)
    metrics_port: int = Field(default=0, ge=0, le=65535, description="0 disables the /metrics listener")
    metrics_host: str = Field(default="127.0.0.1", description="0.0.0.0 where Prometheus scrapes pods")
    # Placement policy (dispatcher.placement.PlacementPolicy).
    placement: Literal["scored", "least-loaded"] = Field(
        default="scored", description="`least-loaded` is the baseline, kept for comparisons"
    )
    objective: Literal["latency", "score"] = Field(
        default="latency",
        description="latency: the worker with the lowest predicted time to first token "
        "(plumbing.latency); score: the highest weighted sum of the scorers",
    )
    scorer_weights: dict[str, float] = Field(
        default_factory=default_weights,
        description="the weight of each placement scorer (dispatcher.scorers), as JSON; "
        "names left out keep their default weight",
    )
    kv_reserve_fraction: float = Field(default=0.05, ge=0, lt=1)
    max_queue: int = Field(
        default=64, gt=0, description="the most requests queued at a worker (the fixed depth)"
    )
    queue_depth: Literal["derived", "fixed"] = Field(
        default="derived",
        description="derived: a worker queues beyond its slots what it finishes in queue_refill_s; "
        "fixed: max_queue",
    )
    queue_refill_s: float = Field(
        default=0.1, gt=0, description="derived queue depth: the time it covers at the worker's finish rate"
    )
    min_queue: int = Field(default=2, gt=0, description="derived queue depth: at least this many")
    expected_output_tokens: int = Field(default=256, gt=0)
    spill_tokens: int = Field(
        default=2048, ge=0, description="hold a request rather than prefill this many more tokens elsewhere"
    )
    spill_after_s: float = Field(default=5.0, ge=0, description="how long a request holds out for its prefix")

    @model_validator(mode="before")
    @classmethod
    def _no_retired_weights(cls, data: Any) -> Any:
        problem = retired_weights(os.environ)
        if problem is not None:
            raise ValueError(problem)
        return data

    @field_validator("scorer_weights")
    @classmethod
    def _known_scorers(cls, weights: dict[str, float]) -> dict[str, float]:
        problem = weights_problem(weights)
        if problem is not None:
            raise ValueError(problem)
        return weights

    def policy(self, latency: LatencyConfig | None = None) -> PlacementPolicy:
        """The placement policy, with the pool's latency targets and priors (`latency`) where given."""
        pool = latency or LatencyConfig()
        chunk = LatencyDefaults().chunk_tokens
        return PlacementPolicy(
            objective=self.objective,
            latency=LatencyDefaults(pool.prefill_tokens_per_s, pool.step_ms / 1000, chunk),
            ttft_slo_s=pool.ttft_slo_ms / 1000,
            tpot_slo_s=pool.tpot_slo_ms / 1000,
            slo_hold_s=pool.slo_hold_s,
            weights={**default_weights(), **self.scorer_weights},
            kv_reserve_fraction=self.kv_reserve_fraction,
            max_queue=self.max_queue,
            queue_depth=self.queue_depth,
            refill_s=self.queue_refill_s,
            min_queue=self.min_queue,
            expected_output_tokens=self.expected_output_tokens,
            batch_headroom_fraction=self.batch_headroom_fraction,
            spill_tokens=self.spill_tokens,
            spill_after_s=self.spill_after_s,
        )


RETIRED_WEIGHTS = {"SLUICE_PREFIX_WEIGHT": "prefix", "SLUICE_KV_WEIGHT": "kv", "SLUICE_QUEUE_WEIGHT": "queue"}


def retired_weights(environ: Mapping[str, str]) -> str | None:
    """Why the environment cannot be used: it sets a weight by a name the settings no longer have (it
    would be ignored, and the default weight used)."""
    for name, scorer in RETIRED_WEIGHTS.items():
        if name in environ:
            example = f'{{"{scorer}": {environ[name]}}}'
            return f"{name} is replaced by SLUICE_SCORER_WEIGHTS (JSON), e.g. '{example}'"
    return None
