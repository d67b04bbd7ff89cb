"""The scaling policy against a small fleet model: replicas take 3 minutes to start."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from scaler.forecast import ArrivalEstimator
from scaler.policy import PoolSignals, ScalerMemory, ScalingPolicy, Verdict, decide, desired_replicas

CAPACITY = 5.0  # requests/s per replica
STARTUP = 180.0
TICK = 10.0
SLO_S = 30.0


@dataclass
class Fleet:
    ready: int = 1
    starting: list[float] = field(default_factory=list)  # when each becomes ready
    backlog: float = 0.0
    arrived: float = 0.0
    violation_s: float = 0.0
    actions: list[str] = field(default_factory=list)
    peak: int = 1

    def step(self, now: float, rate: float) -> None:
        self.ready += sum(1 for t in self.starting if t <= now)
        self.starting = [t for t in self.starting if t > now]
        self.arrived += rate * TICK
        self.backlog += rate * TICK
        self.backlog = max(0.0, self.backlog - self.ready * CAPACITY * TICK)
        if self.backlog / max(self.ready * CAPACITY, 1e-9) > SLO_S:
            self.violation_s += TICK  # queued work would wait longer than the SLO
        self.peak = max(self.peak, self.ready + len(self.starting))

    def apply(self, now: float, target: int, action: str) -> None:
        current = self.ready + len(self.starting)
        if target > current:
            self.starting += [now + STARTUP] * (target - current)
        elif target < current:
            self.ready -= current - target  # drained (instant in this model)
        if action != "hold":
            self.actions.append(action)


def run(rate_at: Callable[[float], float], scaler: Callable[[Fleet, float, ArrivalEstimator], Verdict],
        duration: float) -> Fleet:  # fmt: skip
    fleet = Fleet()
    estimator = ArrivalEstimator()
    now = 0.0
    while now < duration:
        fleet.step(now, rate_at(now))
        estimator.observe(now, int(fleet.arrived))
        verdict = scaler(fleet, now, estimator)
        fleet.apply(now, verdict.target, verdict.action)
        now += TICK
    return fleet


def ours(policy: ScalingPolicy) -> Callable[[Fleet, float, ArrivalEstimator], Verdict]:
    memory = ScalerMemory()

    def scale(fleet: Fleet, now: float, est: ArrivalEstimator) -> Verdict:
        starting = len(fleet.starting)
        state = PoolSignals(
            now, int(fleet.backlog), est.rate, est.trend, fleet.ready, starting, 0, CAPACITY, STARTUP
        )
        return decide(state, policy, memory)

    return scale


POLICY = ScalingPolicy(min_replicas=1, max_replicas=16, queue_slo_s=SLO_S, cooldown_s=300)


def test_a_ramp_is_met_ahead_of_a_three_minute_start_up() -> None:
    def ramp(t: float) -> float:
        return 2 + 38 * min(1.0, t / 900)  # 2 -> 40 req/s over 15 minutes

    forecasting = run(ramp, ours(POLICY), duration=1800)
    # Replicas are asked for a start-up ahead of need, so the queue SLO holds all along the ramp.
    assert forecasting.violation_s <= 60, f"forecasting policy broke the SLO for {forecasting.violation_s} s"
    assert "up" in forecasting.actions


def test_a_spike_then_calm_does_not_flap() -> None:
    def spike(t: float) -> float:
        return 60.0 if 100 <= t < 130 else 1.0  # 1,800 requests in 30 s, then calm

    fleet = run(spike, ours(POLICY), duration=2400)
    assert "up" in fleet.actions
    first_down = fleet.actions.index("down") if "down" in fleet.actions else len(fleet.actions)
    assert "up" not in fleet.actions[first_down:], f"flapped: {fleet.actions}"
    assert fleet.ready == 1, "back to the minimum after the calm"
    assert fleet.violation_s <= STARTUP + 60  # only while the first new replicas were starting


def signals(**overrides: float) -> PoolSignals:
    base = {"now": 0.0, "backlog": 0, "arrival_rate": 1.0, "arrival_trend": 0.0, "ready": 4, "starting": 0,
            "draining": 0, "capacity_per_replica": CAPACITY, "startup_s": STARTUP}  # fmt: skip
    base.update(overrides)
    return PoolSignals(**base)  # type: ignore[arg-type]


def test_scale_down_waits_for_the_cooldown_and_drains_one_at_a_time() -> None:
    memory = ScalerMemory()
    assert decide(signals(now=0), POLICY, memory).action == "hold"
    assert "cooling down" in decide(signals(now=299), POLICY, memory).reason
    down = decide(signals(now=301), POLICY, memory)
    assert (down.action, down.target) == ("down", 3)
    busy = decide(signals(now=400, ready=3, draining=1), POLICY, memory)
    assert (busy.action, busy.target) == ("hold", 3)
    assert "drain" in busy.reason
    assert decide(signals(now=340, ready=3), POLICY, memory).action == "hold", "one step per minute"
    assert decide(signals(now=362, ready=3), POLICY, memory).action == "down"


def test_scale_up_is_immediate_and_capped() -> None:
    verdict = decide(signals(backlog=100_000, ready=1), POLICY, ScalerMemory())
    assert (verdict.action, verdict.target) == ("up", 16)
    assert "capped" in verdict.reason


def test_scale_to_zero_and_activation() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=4, scale_to_zero=True)
    assert desired_replicas(signals(arrival_rate=0.0, ready=0), policy)[0] == 0
    assert desired_replicas(signals(arrival_rate=0.0, backlog=1, ready=0), policy)[0] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_replicas": 5, "max_replicas": 2}, "exceeds"),
        ({"min_replicas": 0}, "scale_to_zero"),
        ({"target_utilization": 0}, "target_utilization"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScalingPolicy(**kwargs)  # type: ignore[arg-type]


def test_estimator_follows_a_linear_ramp() -> None:
    est = ArrivalEstimator()
    total = 0.0
    for i in range(200):
        t = i * TICK
        total += (2 + 0.05 * t) * TICK
        est.observe(t, int(total))
    assert est.rate == pytest.approx(2 + 0.05 * 1990, rel=0.1)
    assert est.trend == pytest.approx(0.05, rel=0.25)


def test_estimator_trend_stays_steady_under_poisson_noise() -> None:
    """The trend is multiplied by a start-up of minutes: its noise must not become replicas. Steady
    Poisson arrivals at 36 requests/s read every 5 s; the forecast 180 s ahead stays near 36."""
    rng = random.Random(7)
    est = ArrivalEstimator()
    total, errors = 0, []
    for i in range(720):
        t = i * 5.0
        total += sum(poisson(rng, 36.0) for _ in range(5))
        est.observe(t, total)
        if t >= 600:
            errors.append(est.forecast(180.0) - 36.0)
    assert max(abs(e) for e in errors) < 6.0, f"forecast 180 s ahead off by up to {max(map(abs, errors)):.1f}"
    assert statistics.pstdev(errors) < 2.0


def poisson(rng: random.Random, mean: float) -> int:
    """Arrivals in one second at `mean` per second (the count of exponential gaps that fit)."""
    count, t = 0, rng.expovariate(mean)
    while t < 1.0:
        count, t = count + 1, t + rng.expovariate(mean)
    return count


def test_estimator_restarts_on_a_falling_counter_and_clips_a_long_gap() -> None:
    est = ArrivalEstimator()
    for i in range(30):
        est.observe(i * 10.0, 10_000_000 + i * 100)  # 10 requests/s
    est.observe(300.0, 0)  # the topic was recreated (or the read failed)
    est.observe(310.0, 100)
    assert est.forecast(180.0) == pytest.approx(10.0), "the drop is not counted as arrivals"
    # An hour without a reading, then a ramp: the gap counts only for its last part in the window.
    total = 100
    for i in range(1, 31):
        t = 3910.0 + i * 10
        total += int((10 + 0.1 * i * 10) * 10)
        rate, trend = est.observe(t, total)
    assert rate == pytest.approx(40.0, abs=6.0)
    assert trend > 0.05
