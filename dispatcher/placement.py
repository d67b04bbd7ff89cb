"""Placement decisions. Pure: the live dispatcher, the tests and the simulator call the same code.

Hard filters first (ready, fresh heartbeat, enough free KV blocks for the uncached prompt plus the
expected output after a reserve, queue under its depth; batch requests also leave spare KV blocks and
running slots). Then, with the `latency` objective (the default), the worker with the lowest predicted
time to first token (plumbing.latency: the prefill queued there, the request's own uncached tokens,
the wait for a slot, an adapter to load), among those where the requests running would keep their
inter-token SLO; an interactive request that no worker can serve within its TTFT SLO is held for up to
`slo_hold_s` (placed at once if it is sheddable and refused instead). With the `score` objective, the
weighted sum of the registered scorers (dispatcher.scorers: prefix match ratio, KV headroom after
placement, queue depth relative to the other candidates, whether the worker holds the request's LoRA
adapter). Ties are broken at random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from dispatcher.scorers import Candidates, default_weights, weighted_sum, weights_problem
from plumbing.latency import LatencyDefaults, heartbeat_ttft, itl_after, predicted_ttft, prefill_s
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
    # `latency`: the lowest predicted time to first token; `score`: the highest weighted sum of scores.
    objective: Literal["latency", "score"] = "latency"
    latency: LatencyDefaults = field(default_factory=LatencyDefaults)
    # The pool's SLOs for a request that states none (headers x-slo-ttft-ms and x-slo-tpot-ms).
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    # How long an interactive request that no worker can serve within its TTFT SLO waits in the hold
    # for one that can, before it goes to the one predicted soonest.
    slo_hold_s: float = 10.0
    # The latency objective's price of the stall a prefill puts on the requests already at a worker:
    # seconds of their time per second of its own time to first token.
    stall_weight: float = 0.02

    def __post_init__(self) -> None:
        problem = weights_problem(self.weights)
        if problem is not None:
            raise ValueError(problem)
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0 or self.slo_hold_s < 0:
            raise ValueError("the SLOs must be > 0 and slo_hold_s >= 0")


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
    ttft_slo_s: float | None = None  # its own SLOs (None: the pool's)
    tpot_slo_s: float | None = None
    sheddable: bool = False  # refused (429) rather than held when no worker can meet its TTFT SLO


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A worker as the dispatcher sees it: its last heartbeat, what was placed on it since, and its cache."""

    heartbeat: Heartbeat
    in_flight: int = 0
    in_flight_blocks: int = 0
    matched_blocks: int = 0
    in_flight_tokens: int = 0  # uncached prompt tokens placed on it since its heartbeat

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
    predicted_ttft_s: float = math.nan  # the latency model's prediction, uncorrected, where it chose
    uncached_tokens: int = 0  # prompt tokens the chosen worker will compute
    refused: bool = False  # a sheddable request no worker can serve within its SLO: answer 429
    # For the placement's trace span: the chosen worker's score (weighted sum, higher better; or the
    # corrected predicted TTFT in seconds, lower better) and the next best worker with its score.
    score: float = math.nan
    runner_up: str | None = None
    runner_up_score: float = math.nan

    @property
    def held(self) -> bool:
        return self.worker_id is None and not self.refused


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
SLO_REASON = "no worker can meet its TTFT SLO"
SHED_REASON = "no worker can meet its TTFT SLO; refused as sheddable"


def waits_for_affinity(
    chosen_matched: int, best_matched: int, block_size: int, demand: Demand, policy: PlacementPolicy
) -> bool:
    """Whether to hold the request rather than send it to a worker holding `chosen_matched` blocks of its
    prompt, when a busy eligible worker holds `best_matched`: it would prefill `spill_tokens` more there,
    and it has waited less than `spill_after_s`."""
    extra = (best_matched - chosen_matched) * block_size
    return extra >= policy.spill_tokens and demand.waited_s < policy.spill_after_s


def uncached_tokens(demand: Demand, matched_blocks: int, block_size: int) -> int:
    """Prompt tokens a worker holding `matched_blocks` of the prompt computes (at least one: the engine
    computes the last prompt token again to sample from it)."""
    return max(1, demand.prompt_tokens - matched_blocks * block_size)


def predicted_row(
    worker: WorkerSnapshot, demand: Demand, now: float, policy: PlacementPolicy
) -> tuple[float, float, float, float, float]:
    """The latency model on one worker: (corrected TTFT, uncorrected TTFT, ITL of its running requests
    after, corrected TTFT were nothing queued there, the stall its prefill puts on the requests running
    and waiting there, summed), all in seconds (plumbing.latency)."""
    hb, d = worker.heartbeat, policy.latency
    own = uncached_tokens(demand, worker.matched_blocks, hb.block_size)
    _, raw = heartbeat_ttft(hb, own, now, d, worker.in_flight_tokens, worker.in_flight)
    adapter_s = 0.0 if holds_adapter(worker, demand) else d.adapter_load_s
    raw += adapter_s
    rate = hb.prefill_tokens_per_s or d.prefill_tokens_per_s
    step = hb.step_s or d.step_s
    itl = float(itl_after(float(own), rate, step, policy.expected_output_tokens))
    alone = float(predicted_ttft(float(own), 0.0, rate, step, d.chunk_tokens)) + adapter_s
    stall = float(prefill_s(float(own), rate, step, d.chunk_tokens)) * worker.load
    return raw * hb.ttft_correction, raw, itl, alone * hb.ttft_correction, stall


def latency_choice(
    ttft: npt.NDArray[np.float64],
    itl: npt.NDArray[np.float64],
    fit: npt.NDArray[np.bool_],
    busy: npt.NDArray[np.bool_],
    demand: Demand,
    policy: PlacementPolicy,
    rng: random.Random,
    alone: npt.NDArray[np.float64] | None = None,
    stall: npt.NDArray[np.float64] | None = None,
    held: npt.NDArray[np.bool_] | None = None,
) -> tuple[int | None, str]:
    """The row with the lowest predicted TTFT among those that can take the request (`fit`, at least
    one), preferring rows where the running requests keep their ITL SLO; or None and why it waits:
    an eligible row that cannot take it now (`busy`) would serve it sooner by more than `spill_tokens`
    of prefill, or no row meets its TTFT SLO (interactive requests only). Waiting can only help where
    the queues cause the miss: a request that no row could serve within its SLO with nothing queued
    (`alone`, the TTFT with an empty queue) is placed at once. Among the rows, the lowest TTFT plus
    `stall_weight` times the `stall` the request's prefill puts on the others there wins. A request for
    a LoRA adapter stays among the rows where its adapter can start (`held`: held there, or an adapter
    slot free) while one of them meets its SLO: an engine runs few adapters at once and passes over a
    request for another until one frees, a wait the model does not see."""
    slo = demand.ttft_slo_s or policy.ttft_slo_s
    rows = np.flatnonzero(fit)
    if demand.priority is Priority.INTERACTIVE:
        keep = rows[itl[rows] <= (demand.tpot_slo_s or policy.tpot_slo_s)]
        rows = keep if keep.size else rows
    if held is not None:
        holders = rows[held[rows]]
        rows = holders if holders.size and float(ttft[holders].min()) <= slo else rows
    best = float(ttft[rows].min())
    if busy.any() and demand.waited_s < policy.spill_after_s:
        spill_s = policy.spill_tokens / policy.latency.prefill_tokens_per_s
        if float(ttft[busy].min()) + spill_s <= best:
            return None, AFFINITY_REASON
    queues_miss = alone is None or float(alone[rows].min()) <= slo
    if demand.priority is Priority.INTERACTIVE and best > slo and queues_miss:
        if demand.sheddable:
            return None, SHED_REASON
        if demand.waited_s < policy.slo_hold_s:
            return None, SLO_REASON
    cost = ttft[rows] if stall is None else ttft[rows] + policy.stall_weight * stall[rows]
    cost = np.nan_to_num(cost, nan=np.inf, posinf=np.inf)  # a figure gone bad ranks last, never crashes
    winners = rows[cost <= cost.min() + 1e-9]
    return int(winners[rng.randrange(len(winners))]), ""


def holds_adapter(worker: WorkerSnapshot, demand: Demand) -> bool:
    """Whether the worker holds the request's adapter (always, for a request without one)."""
    return demand.adapter is None or demand.adapter in worker.heartbeat.adapters


def adapter_ready(worker: WorkerSnapshot, demand: Demand) -> bool:
    """Whether the worker can start the request's adapter without waiting for another to free: it holds
    it, or fewer adapters than its engine runs at once are in use there."""
    hb = worker.heartbeat
    return holds_adapter(worker, demand) or not hb.adapter_slots or hb.adapters_in_use < hb.adapter_slots


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
    if policy.objective == "latency":
        return choose_by_latency(verdicts, demand, now, policy, rng)
    busy = [w.matched_blocks for w, why in verdicts if why is not None and is_eligible(w, now)]
    best_fit = max(w.matched_blocks for w in fit)
    if busy and waits_for_affinity(best_fit, max(busy), fit[0].heartbeat.block_size, demand, policy):
        return Decision(None, reason=AFFINITY_REASON)
    scores = weighted_sum(candidates(fit, demand, policy), policy.weights)
    best = scores.max()
    winner = rng.choice([w for s, w in zip(scores, fit, strict=True) if s >= best - 1e-9])
    needed = blocks_needed(demand, winner.matched_blocks, winner.heartbeat.block_size, policy)
    return Decision(winner.worker_id, winner.matched_blocks, needed)


def choose_by_latency(
    verdicts: Sequence[tuple[WorkerSnapshot, str | None]],
    demand: Demand,
    now: float,
    policy: PlacementPolicy,
    rng: random.Random,
) -> Decision:
    """`choose` with the latency objective, over the workers and why each cannot take the request."""
    rows = [predicted_row(w, demand, now, policy) for w, _ in verdicts]
    ttft = np.array([r[0] for r in rows])
    itl = np.array([r[2] for r in rows])
    fit = np.array([why is None for _, why in verdicts])
    busy = np.array([why is not None and is_eligible(w, now) for w, why in verdicts])
    alone = np.array([r[3] for r in rows])
    stall = np.array([r[4] for r in rows])
    held = np.array([adapter_ready(w, demand) for w, _ in verdicts])
    i, reason = latency_choice(ttft, itl, fit, busy, demand, policy, rng, alone, stall, held)
    if i is None:
        return Decision(None, reason=reason, refused=reason == SHED_REASON)
    winner = verdicts[i][0]
    needed = blocks_needed(demand, winner.matched_blocks, winner.heartbeat.block_size, policy)
    own = uncached_tokens(demand, winner.matched_blocks, winner.heartbeat.block_size)
    return Decision(winner.worker_id, winner.matched_blocks, needed, "", rows[i][1], own)


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
