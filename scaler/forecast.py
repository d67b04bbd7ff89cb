"""Arrival rate and its trend from a growing counter (the sum of a topic's end offsets). Pure.

A least-squares line through the rates of the last `window_s` seconds (each interval between two counter
readings weighted by its length): its value now is the rate, its slope the trend, so the policy can ask
what the rate will be one replica start-up from now.

The window, not per-tick smoothing, keeps the trend steady: the trend is multiplied by a start-up of
minutes, so its noise becomes replicas. Poisson arrivals at rate r over a window of W seconds give the
slope a standard deviation of about sqrt(12 r / W^3): at 36 requests/s and 300 s, 0.004 requests/s per
second, under a request per second after a 180 s start-up. Holt's smoothing of 5 s counts (alpha 0.4,
beta 0.2) misses by 8.7 requests/s (standard deviation of the forecast 180 s ahead) on the simulator's
diurnal day, this line by 2.3 (`docs/benchmarks.md`).
"""

from __future__ import annotations

import itertools
from collections import deque

WINDOW_S = 300.0


def fit_line(points: list[tuple[float, float, float]], at: float) -> tuple[float, float]:
    """(value at `at`, slope) of the weighted least-squares line through (x, y, weight) points; a flat line
    through their weighted mean when the x values do not spread."""
    total = sum(w for _, _, w in points)
    if total <= 0:
        return 0.0, 0.0
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    if spread <= 1e-12:
        return mean_y, 0.0
    slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread
    return mean_y + slope * (at - mean_x), slope


class ArrivalEstimator:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.rate = 0.0
        self.trend = 0.0
        self._readings: deque[tuple[float, int]] = deque()

    def observe(self, now: float, total: int) -> tuple[float, float]:
        """Feed the counter's value at `now`; returns (rate per second, trend per second per second).

        A counter that falls (a topic recreated, a failed read) starts the readings again from its new
        value rather than counting the jump back as arrivals on the next reading."""
        if self._readings and now <= self._readings[-1][0]:
            return self.rate, self.trend
        if self._readings and total < self._readings[-1][1]:
            self._readings.clear()
        self._readings.append((now, total))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        if len(self._readings) < 2:
            return self.rate, self.trend
        start = now - self.window_s
        points = []
        for (t0, c0), (t1, c1) in itertools.pairwise(self._readings):
            inside = max(t0, start)  # an interval reaching back past the window counts for its part in it
            points.append(((inside + t1) / 2, (c1 - c0) / (t1 - t0), t1 - inside))
        if len(points) < 3:  # two rates are not a trend: their weighted mean, flat
            level, slope = fit_line([(now, y, w) for _, y, w in points], now)
        else:
            level, slope = fit_line(points, now)
        self.rate, self.trend = max(0.0, level), slope
        return self.rate, self.trend

    def forecast(self, horizon_s: float) -> float:
        return max(0.0, self.rate + self.trend * horizon_s)
