"""Lag status per partition and per pool, in Burrow's terms, over a window of observations. Pure.

Each tick records (time, committed offset, lag) per partition. Over the window:
- OK: lag was zero at some point;
- STOP: lag but no consumer in the group (nobody is committing);
- STALL: lag and consumers, but the committed offset never moved;
- REWIND: the committed offset went backwards;
- WARN: lag never decreased (and was not zero);
- otherwise OK (the consumer is keeping up).
The pool's status is its worst partition's; STOP, STALL and REWIND make the pool ERR.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from enum import StrEnum


class Status(StrEnum):
    OK = "OK"
    WARN = "WARN"
    STALL = "STALL"
    STOP = "STOP"
    REWIND = "REWIND"
    ERR = "ERR"


SEVERITY = {Status.OK: 0, Status.WARN: 1, Status.STALL: 2, Status.REWIND: 2, Status.STOP: 3, Status.ERR: 3}


def partition_status(window: Iterable[tuple[float, int, int]], has_consumers: bool) -> Status:
    """Status of one partition from its (time, committed offset, lag) observations, oldest first."""
    points = list(window)
    if not points:
        return Status.OK
    lags = [lag for _, _, lag in points]
    offsets = [off for _, off, _ in points]
    if min(lags) == 0:
        return Status.OK
    if any(b < a for a, b in itertools.pairwise(offsets)):
        return Status.REWIND
    if not has_consumers:
        return Status.STOP
    if len(points) > 1 and offsets[0] == offsets[-1]:
        return Status.STALL
    if len(points) > 1 and all(b >= a for a, b in itertools.pairwise(lags)) and lags[-1] > lags[0]:
        return Status.WARN
    return Status.OK


def pool_status(partitions: Mapping[int, Status]) -> Status:
    worst = max(partitions.values(), key=SEVERITY.__getitem__, default=Status.OK)
    return Status.ERR if worst in (Status.STOP, Status.STALL, Status.REWIND) else worst


class LagWindow:
    """The last `size` observations of each partition."""

    def __init__(self, size: int = 10) -> None:
        self.size = size
        self._points: dict[int, deque[tuple[float, int, int]]] = {}

    def record(self, now: float, partition: int, committed: int, lag: int) -> None:
        self._points.setdefault(partition, deque(maxlen=self.size)).append((now, committed, lag))

    def statuses(self, has_consumers: bool) -> dict[int, Status]:
        return {p: partition_status(points, has_consumers) for p, points in self._points.items()}
