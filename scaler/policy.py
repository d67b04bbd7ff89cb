"""How many replicas a pool should have. Pure: the live scaler, the tests and the simulator share it.

Desired = enough replicas to serve the arrival rate forecast one start-up time ahead (a new replica takes
minutes, so acting on today's rate is acting too late), plus enough to drain the backlog within the
pool's queueing SLO. Scale up at once to the desired count. Scale down only after the desired count has
stayed below the current one for a whole cooldown, one replica at a time, and only by draining (the
replica takes no new work and leaves when its requests finish); never while another replica drains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from queue_schemas.config import PrefillGroup, ScalingConfig

Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 8
    queue_slo_s: float = 30.0
    target_utilization: float = 0.9
    cooldown_s: float = 300.0
    step_down_every_s: float = 60.0
    scale_to_zero: bool = False

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < 0:
            raise ValueError("min_replicas and max_replicas must be >= 0")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.min_replicas == 0 and self.max_replicas > 0 and not self.scale_to_zero:
            raise ValueError(
                "min_replicas = 0 needs scale_to_zero = true (or max_replicas = 0 to disable the pool)"
            )
        if not 0 < self.target_utilization <= 1:
            raise ValueError("target_utilization must be in (0, 1]")


@dataclass(frozen=True)
class PoolSignals:
    now: float
    backlog: int  # consumer lag (held requests included: they are uncommitted) + undelivered inbox entries
    arrival_rate: float  # requests per second
    arrival_trend: float  # requests per second, per second
    ready: int
    starting: int
    draining: int
    capacity_per_replica: float  # requests per second one replica serves
    startup_s: float


@dataclass(frozen=True)
class Verdict:
    action: Action
    target: int  # replicas (ready + starting) wanted after this tick
    desired: int
    forecast: float
    reason: str


@dataclass
class ScalerMemory:
    below_since: float | None = None
    last_change_at: float = field(default=-math.inf)


def desired_replicas(s: PoolSignals, p: ScalingPolicy) -> tuple[int, float, str]:
    forecast = max(0.0, s.arrival_rate + s.arrival_trend * s.startup_s)
    per_replica = max(1e-9, s.capacity_per_replica * p.target_utilization)
    serve = math.ceil(forecast / per_replica - 1e-9)
    drain = math.ceil(s.backlog / (max(1e-9, s.capacity_per_replica) * p.queue_slo_s) - 1e-9)
    desired = serve + drain
    why = f"forecast {forecast:.2f} req/s needs {serve}, backlog {s.backlog} needs {drain}"
    floor = p.min_replicas
    if floor == 0 and p.max_replicas > 0 and (s.backlog > 0 or forecast > 0):
        floor = 1  # activation: any demand wakes a pool scaled to zero
    if desired < floor:
        desired, why = floor, why + f"; at least {floor}"
    if desired > p.max_replicas:
        desired, why = p.max_replicas, why + f"; capped at {p.max_replicas}"
    return desired, forecast, why


def decide(s: PoolSignals, p: ScalingPolicy, memory: ScalerMemory) -> Verdict:
    """This tick's verdict; updates `memory` (when the desired count first fell below the current one)."""
    desired, forecast, why = desired_replicas(s, p)
    current = s.ready + s.starting
    if desired > current:
        memory.below_since = None
        memory.last_change_at = s.now
        return Verdict("up", desired, desired, forecast, why)
    if desired == current:
        memory.below_since = None
        return Verdict("hold", current, desired, forecast, why)
    if memory.below_since is None:
        memory.below_since = s.now
    waited = s.now - memory.below_since
    if waited < p.cooldown_s:
        return Verdict(
            "hold", current, desired, forecast, f"{why}; cooling down {waited:.0f}/{p.cooldown_s:.0f} s"
        )
    if s.draining:
        return Verdict("hold", current, desired, forecast, f"{why}; waiting for a replica to drain")
    if s.now - memory.last_change_at < p.step_down_every_s:
        return Verdict(
            "hold", current, desired, forecast, f"{why}; one step down per {p.step_down_every_s:.0f} s"
        )
    memory.last_change_at = s.now
    return Verdict("down", current - 1, desired, forecast, f"{why}; draining one replica")


def policy_from_config(config: ScalingConfig) -> ScalingPolicy:
    """The pool file's scaling section as a policy; raises ValueError naming what is inconsistent."""
    return ScalingPolicy(
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        queue_slo_s=config.queue_slo_s,
        target_utilization=config.target_utilization,
        cooldown_s=config.cooldown_s,
        step_down_every_s=config.step_down_every_s,
        scale_to_zero=config.scale_to_zero,
    )


def prefill_target(group: PrefillGroup, decode_replicas: int) -> int:
    """Prefill replicas for a pool with `decode_replicas` decode workers: `per_decode` each, rounded up,
    within the group's bounds."""
    return max(group.min_replicas, min(group.max_replicas, math.ceil(group.per_decode * decode_replicas)))
