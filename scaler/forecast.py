"""Arrival rate and its trend from a growing counter (the sum of a topic's end offsets). Pure.

Holt's linear smoothing: the level follows the observed rate, the trend follows how fast the level
moves, so the policy can ask what the rate will be one replica start-up from now.
"""

from __future__ import annotations


class ArrivalEstimator:
    def __init__(self, alpha: float = 0.4, beta: float = 0.2) -> None:
        self.alpha = alpha
        self.beta = beta
        self.rate = 0.0
        self.trend = 0.0
        self._last: tuple[float, int] | None = None

    def observe(self, now: float, total: int) -> tuple[float, float]:
        """Feed the counter's value at `now`; returns (rate per second, trend per second per second)."""
        if self._last is None:
            self._last = (now, total)
            return self.rate, self.trend
        then, before = self._last
        dt = now - then
        if dt <= 0:
            return self.rate, self.trend
        observed = max(0, total - before) / dt
        previous = self.rate
        predicted = previous + self.trend * dt
        self.rate = max(0.0, self.alpha * observed + (1 - self.alpha) * predicted)
        self.trend = self.beta * (self.rate - previous) / dt + (1 - self.beta) * self.trend
        self._last = (now, total)
        return self.rate, self.trend

    def forecast(self, horizon_s: float) -> float:
        return max(0.0, self.rate + self.trend * horizon_s)
