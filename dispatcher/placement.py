"""Placement decisions. Pure: the live dispatcher, the tests and the simulator call the same code."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from queue_schemas.messages import Heartbeat, WorkerState


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A worker as the dispatcher sees it: its last heartbeat plus what was placed on it since."""

    heartbeat: Heartbeat
    in_flight: int = 0

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id

    @property
    def load(self) -> int:
        hb = self.heartbeat
        return hb.running + hb.waiting + hb.inbox_pending + self.in_flight


def is_eligible(worker: WorkerSnapshot, now: float) -> bool:
    """Ready, and its heartbeat has not outlived its TTL."""
    hb = worker.heartbeat
    return hb.state is WorkerState.READY and now - hb.sent_at <= hb.ttl_ms / 1000


def least_loaded(workers: Sequence[WorkerSnapshot], now: float, rng: random.Random) -> str | None:
    """The eligible worker with the fewest running, waiting and just-placed requests; random among ties."""
    eligible = [w for w in workers if is_eligible(w, now)]
    if not eligible:
        return None
    lowest = min(w.load for w in eligible)
    return rng.choice([w.worker_id for w in eligible if w.load == lowest])
