"""Placement decisions. Pure: the live dispatcher, the tests and the simulator call the same code.

Hard filters first (ready, fresh heartbeat, enough free KV blocks for the uncached prompt plus the
expected output after a reserve, queue under its depth; batch requests also leave spare KV blocks and
running slots), then the weighted sum of the registered scorers (dispatcher.scorers: prefix match
ratio, KV headroom after placement, queue depth relative to the other candidates, whether the worker
holds the request's LoRA adapter). Ties are broken at random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from dispatcher.scorers import Candidates, default_weights, weighted_sum, weights_problem
from queue_schemas.messages import Heartbeat, Priority, WorkerState


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """`weights`: each registered scorer's weight (dispatcher.scorers; each scorer's module says where its
    default comes from)."""

    weights: Mapping[str, float] = field(default_factory=default_weights)
    kv_reserve_fraction: float = 0.05
    max_queue: int = 64
    expected_output_tokens: int = 256
    batch_headroom_fraction: float = 0.25
    # A request is not sent where it would prefill `spill_tokens` or more tokens than on a worker that
    # holds more of its prompt but cannot take it now (queue full, KV short); it waits in the hold for
    # that worker, for up to `spill_after_s`, and only then goes wherever it fits.
    spill_tokens: int = 2048
    spill_after_s: float = 5.0
    # How much may wait at a worker beyond its running slots. `derived`: what it finishes in `refill_s`
    # (its measured completion rate), at least `min_queue`, at most `max_queue`: enough that a slot it
    # frees finds the next request there while the dispatcher refills it, and no more, so waiting
    # happens in the dispatcher's hold, where the team order applies. `fixed`: `max_queue` queued.
    queue_depth: Literal["derived", "fixed"] = "derived"
    refill_s: float = 0.1
    min_queue: int = 2

    def __post_init__(self) -> None:
        problem = weights_problem(self.weights)
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True, slots=True)
class Demand:
    """What a request asks of a worker."""

    prompt_tokens: int
    block_hashes: Sequence[str]
    max_tokens: int
    priority: Priority = Priority.INTERACTIVE
    waited_s: float = 0.0  # how long it has been held
    # Its team has nothing else waiting in the hold: it may go past a worker's queue depth by the
    # worker's light slots, which start an interactive request of a team under its share at once.
    light: bool = False
    adapter: str | None = None  # the LoRA adapter it runs under


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A worker as the dispatcher sees it: its last heartbeat, what was placed on it since, and its cache."""

    heartbeat: Heartbeat
    in_flight: int = 0
    in_flight_blocks: int = 0
    matched_blocks: int = 0

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id

    @property
    def queue(self) -> int:
        hb = self.heartbeat
        return hb.waiting + hb.inbox_pending + self.in_flight

    @property
    def load(self) -> int:
        return self.heartbeat.running + self.queue


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str | None
    matched_blocks: int = 0
    blocks_needed: int = 0
    reason: str = ""


def blocks_needed(demand: Demand, matched_blocks: int, block_size: int, policy: PlacementPolicy) -> int:
    """KV blocks the request will take on a worker that already holds `matched_blocks` of its prompt."""
    uncached = max(0, demand.prompt_tokens - matched_blocks * block_size)
    output = min(demand.max_tokens, policy.expected_output_tokens)
    return math.ceil((uncached + output) / block_size)


def is_eligible(worker: WorkerSnapshot, now: float) -> bool:
    """Ready, and its heartbeat has not outlived its TTL."""
    hb = worker.heartbeat
    return hb.state is WorkerState.READY and now - hb.sent_at <= hb.ttl_ms / 1000


def headroom_after(worker: WorkerSnapshot, needed: int) -> float:
    hb = worker.heartbeat
    if hb.kv_blocks_total <= 0:
        return 0.0
    return (hb.kv_blocks_free - worker.in_flight_blocks - needed) / hb.kv_blocks_total


def batch_room(worker: WorkerSnapshot, after: float, policy: PlacementPolicy) -> bool:
    """A batch request leaves the headroom fraction of the worker's KV blocks, and of its running slots,
    free for interactive requests."""
    if after < policy.batch_headroom_fraction:
        return False
    slots = worker.heartbeat.max_running
    return slots <= 0 or worker.load < slots * (1 - policy.batch_headroom_fraction)


def queue_depth(heartbeat: Heartbeat, policy: PlacementPolicy) -> int:
    """How many requests may wait at a worker beyond its running slots (see PlacementPolicy)."""
    if policy.queue_depth == "fixed":
        return policy.max_queue
    derived = math.ceil(heartbeat.completed_per_s * policy.refill_s)
    return max(1, min(policy.max_queue, max(policy.min_queue, derived)))


def queue_full(worker: WorkerSnapshot, policy: PlacementPolicy, light: bool = False) -> bool:
    """Whether as much waits at the worker as its depth allows (for a light request, its depth plus its
    light slots). With a derived depth, what waits is its load beyond its running slots (placements its
    last heartbeat does not show yet count). A queue that
    forms inside the engine with slots free (short of KV blocks) is bounded by `max_queue` only: an
    interactive request goes ahead of the batch requests waiting there (engine priority), and a batch
    request is not sent to a worker without KV headroom in the first place."""
    hb = worker.heartbeat
    depth = queue_depth(hb, policy) + (hb.light_slots if light else 0)
    if policy.queue_depth == "fixed" or hb.max_running <= 0:
        return worker.queue >= depth
    return worker.load - hb.max_running >= depth or worker.queue >= policy.max_queue


def rejection(worker: WorkerSnapshot, demand: Demand, now: float, policy: PlacementPolicy) -> str | None:
    """Why the worker cannot take the request now, or None if it can."""
    if not is_eligible(worker, now):
        return "not ready or stale"
    if queue_full(worker, policy, demand.light):
        return "queue full"
    needed = blocks_needed(demand, worker.matched_blocks, worker.heartbeat.block_size, policy)
    after = headroom_after(worker, needed)
    if after < policy.kv_reserve_fraction:
        return "not enough free KV blocks"
    if demand.priority is Priority.BATCH and not batch_room(worker, after, policy):
        return "no headroom left for batch"
    return None


AFFINITY_REASON = "waiting for the worker that holds its prefix"


def waits_for_affinity(
    chosen_matched: int, best_matched: int, block_size: int, demand: Demand, policy: PlacementPolicy
) -> bool:
    """Whether to hold the request rather than send it to a worker holding `chosen_matched` blocks of its
    prompt, when a busy eligible worker holds `best_matched`: it would prefill `spill_tokens` more there,
    and it has waited less than `spill_after_s`."""
    extra = (best_matched - chosen_matched) * block_size
    return extra >= policy.spill_tokens and demand.waited_s < policy.spill_after_s


def holds_adapter(worker: WorkerSnapshot, demand: Demand) -> bool:
    """Whether the worker holds the request's adapter (always, for a request without one)."""
    return demand.adapter is None or demand.adapter in worker.heartbeat.adapters


def candidates(workers: Sequence[WorkerSnapshot], demand: Demand, policy: PlacementPolicy) -> Candidates:
    """What the scorers see of `workers`, all of which can take the request."""
    prompt_blocks = len(demand.block_hashes)
    queues = [float(w.queue) for w in workers]
    return Candidates(
        prefix_ratio=np.array([w.matched_blocks / prompt_blocks if prompt_blocks else 0.0 for w in workers]),
        headroom=np.array(
            [
                headroom_after(w, blocks_needed(demand, w.matched_blocks, w.heartbeat.block_size, policy))
                for w in workers
            ]
        ),
        queue=np.array(queues),
        queue_lo=min(queues, default=0.0),
        queue_hi=max(queues, default=0.0),
        adapter_held=np.array([1.0 if holds_adapter(w, demand) else 0.0 for w in workers]),
    )


def score(
    worker: WorkerSnapshot, demand: Demand, queue_min: int, queue_max: int, policy: PlacementPolicy
) -> float:
    """The worker's score when the queues of the workers that fit run from `queue_min` to `queue_max`."""
    one = candidates([worker], demand, policy)
    one = replace(one, queue_lo=float(queue_min), queue_hi=float(queue_max))
    return float(weighted_sum(one, policy.weights)[0])


def choose(
    workers: Sequence[WorkerSnapshot],
    demand: Demand,
    now: float,
    policy: PlacementPolicy,
    rng: random.Random,
) -> Decision:
    """The best worker for the request, or a Decision with no worker and the most common reason."""
    verdicts = [(w, rejection(w, demand, now, policy)) for w in workers]
    fit = [w for w, why in verdicts if why is None]
    if not fit:
        reasons = [why or "" for _, why in verdicts]
        reason = max(set(reasons), key=reasons.count) if reasons else "no workers"
        return Decision(None, reason=reason)
    busy = [w.matched_blocks for w, why in verdicts if why is not None and is_eligible(w, now)]
    best_fit = max(w.matched_blocks for w in fit)
    if busy and waits_for_affinity(best_fit, max(busy), fit[0].heartbeat.block_size, demand, policy):
        return Decision(None, reason=AFFINITY_REASON)
    scores = weighted_sum(candidates(fit, demand, policy), policy.weights)
    best = scores.max()
    winner = rng.choice([w for s, w in zip(scores, fit, strict=True) if s >= best - 1e-9])
    needed = blocks_needed(demand, winner.matched_blocks, winner.heartbeat.block_size, policy)
    return Decision(winner.worker_id, winner.matched_blocks, needed)


def choose_least_loaded(
    workers: Sequence[WorkerSnapshot],
    demand: Demand,
    now: float,
    policy: PlacementPolicy,
    rng: random.Random,
) -> Decision:
    """The baseline policy behind the same signature as `choose`: load only, no prefix or KV terms."""
    worker_id = least_loaded(workers, now, rng)
    if worker_id is None:
        return Decision(None, reason="no ready worker")
    worker = next(w for w in workers if w.worker_id == worker_id)
    needed = blocks_needed(demand, worker.matched_blocks, worker.heartbeat.block_size, policy)
    return Decision(worker_id, worker.matched_blocks, needed)


def least_loaded(workers: Sequence[WorkerSnapshot], now: float, rng: random.Random) -> str | None:
    """The baseline: the eligible worker with the fewest running, waiting and just-placed requests."""
    eligible = [w for w in workers if is_eligible(w, now)]
    if not eligible:
        return None
    lowest = min(w.load for w in eligible)
    return rng.choice([w.worker_id for w in eligible if w.load == lowest])
