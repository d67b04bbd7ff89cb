"""The placement function over a columnar table of workers, for dispatchers with hundreds of workers.

`choose_fast` computes exactly what `placement.choose` computes (same filters, same terms, same
tie-breaking among equal best scores), with numpy over columns that are updated when a heartbeat
arrives or a request is placed, instead of Python objects built per decision. `placement.choose` stays
the readable reference; tests check that both pick from the same best set, over tables built from
snapshots. One difference is by design: a snapshot knows only how many prompt tokens were placed on a
worker since its heartbeat, so the reference ages them from the heartbeat's time, while the table
ages each placement's tokens from the time it was made (`WorkerTable.work_at`).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from dispatcher.placement import (
    AFFINITY_REASON,
    SHED_REASON,
    Decision,
    Demand,
    PlacementPolicy,
    WorkerSnapshot,
    latency_choice,
    waits_for_affinity,
)
from dispatcher.scorers import Candidates, Floats, weighted_sum
from plumbing.latency import LatencyDefaults, backlog_now, itl_after, predicted_ttft, prefill_s, slot_wait_s
from queue_schemas.messages import Heartbeat, Priority, WorkerState

COLUMNS = (
    "fresh_until",
    "ready",
    "running",
    "queue_base",
    "free",
    "total",
    "block_size",
    "in_flight",
    "blocks",
    "slots",
    "completed",
    "light",
    "work",  # uncached prompt tokens without a first token as of `since`: its heartbeat's backlog, then
    "since",  # less what it computed between two placements there, plus each placement's tokens
    "rate",  # prefill tokens per second (measured, else the default)
    "step",  # decode step seconds (measured, else the default)
    "correction",  # observed over predicted TTFT
    "adapter_slots",  # LoRA adapters it runs at once (0: none)
    "adapters_in_use",
)


class WorkerTable:
    def __init__(self, capacity: int = 64, latency: LatencyDefaults | None = None) -> None:
        self.latency = latency or LatencyDefaults()
        self.ids: list[str] = []
        self.row: dict[str, int] = {}
        self.layout = 0  # changes whenever a row is added, removed or moved
        self._cols: dict[str, Floats] = {c: np.zeros(capacity) for c in COLUMNS}

    def __len__(self) -> int:
        return len(self.ids)

    def col(self, name: str) -> Floats:
        return self._cols[name][: len(self.ids)]

    def upsert(self, hb: Heartbeat, in_flight: int, in_flight_blocks: int, in_flight_tokens: int = 0) -> None:
        i = self.row.get(hb.worker_id)
        if i is None:
            i = len(self.ids)
            if i == len(self._cols["ready"]):
                self._cols = {c: np.concatenate([a, np.zeros(len(a))]) for c, a in self._cols.items()}
            self.ids.append(hb.worker_id)
            self.row[hb.worker_id] = i
            self.layout += 1
        values = {
            "fresh_until": hb.sent_at + hb.ttl_ms / 1000,
            "ready": 1.0 if hb.state is WorkerState.READY else 0.0,
            "running": hb.running,
            "queue_base": hb.waiting + hb.inbox_pending,
            "free": hb.kv_blocks_free,
            "total": hb.kv_blocks_total,
            "block_size": hb.block_size,
            "in_flight": in_flight,
            "blocks": in_flight_blocks,
            "slots": hb.max_running,
            "completed": hb.completed_per_s,
            "light": hb.light_slots,
            "work": hb.prefill_backlog + in_flight_tokens,
            "since": hb.sent_at,
            "rate": hb.prefill_tokens_per_s or self.latency.prefill_tokens_per_s,
            "step": hb.step_s or self.latency.step_s,
            "correction": hb.ttft_correction,
            "adapter_slots": hb.adapter_slots,
            "adapters_in_use": hb.adapters_in_use,
        }
        for c, v in values.items():
            self._cols[c][i] = v

    def add_in_flight(self, worker_id: str, blocks: int, tokens: int = 0, now: float | None = None) -> None:
        """Count a placement made at `now` (its uncached prompt tokens join the row's prefill work)."""
        i = self.row.get(worker_id)
        if i is not None:
            self._cols["in_flight"][i] += 1
            self._cols["blocks"][i] += blocks
            if now is not None:
                self._cols["work"][i] = self.work_at(now)[i] + tokens
                self._cols["since"][i] = now

    def work_at(self, now: float) -> Floats:
        """Each row's prefill work left at `now` (`latency.backlog_now`: the engine computes its queued
        prompts without pause, so what was queued at `since` has shrunk by what it computes since)."""
        age = now - self.col("since")
        chunk = self.latency.chunk_tokens
        return backlog_now(self.col("work"), age, self.col("rate"), self.col("step"), chunk)

    def remove(self, worker_id: str) -> None:
        i = self.row.pop(worker_id, None)
        if i is None:
            return
        self.layout += 1
        last = len(self.ids) - 1
        if i != last:  # move the last row into the hole
            moved = self.ids[last]
            self.ids[i] = moved
            self.row[moved] = i
            for a in self._cols.values():
                a[i] = a[last]
        self.ids.pop()


def queues_full(
    table: WorkerTable, queue: Floats, policy: PlacementPolicy, light: bool = False
) -> npt.NDArray[np.bool_]:
    """`placement.queue_full` for every row."""
    extra = table.col("light") if light else 0.0
    if policy.queue_depth == "fixed":
        return queue >= policy.max_queue + extra
    derived = np.ceil(table.col("completed") * policy.refill_s)
    depth = np.maximum(1.0, np.minimum(policy.max_queue, np.maximum(policy.min_queue, derived))) + extra
    slots = table.col("slots")
    beyond = (table.col("running") + queue - slots >= depth) | (queue >= policy.max_queue)
    return np.where(slots > 0, beyond, queue >= depth)


def stale_rows(table: WorkerTable, now: float) -> npt.NDArray[np.bool_]:
    """Rows not ready, or whose heartbeat is past its freshness."""
    stale: npt.NDArray[np.bool_] = (table.col("ready") == 0) | (now > table.col("fresh_until"))
    return stale


def queued(table: WorkerTable) -> Floats:
    """What waits at each row: its heartbeat's queue and the placements made since."""
    return table.col("queue_base") + table.col("in_flight")


def refused_by_all(table: WorkerTable, now: float, policy: PlacementPolicy, light: bool = False) -> bool:
    """Whether every row is stale or has a full queue, so that `choose_fast` holds any request (of that
    lightness) whatever it asks: a hold of many requests is retried without scoring each."""
    return bool((stale_rows(table, now) | queues_full(table, queued(table), policy, light)).all())


def choose_fast(
    table: WorkerTable,
    matched: Floats,
    demand: Demand,
    now: float,
    policy: PlacementPolicy,
    rng: random.Random,
    adapter_held: Floats | None = None,
    explain: bool = False,
) -> Decision:
    """`adapter_held`: 1 for each row whose worker holds the request's adapter (None: every row counts
    as holding it, as for a request without one). With `explain`, the decision also names the chosen
    worker's score and the runner-up (for the placement's trace span)."""
    if not len(table):
        return Decision(None, reason="no workers")
    block_size = table.col("block_size")
    total = table.col("total")
    uncached = np.maximum(0.0, demand.prompt_tokens - matched * block_size)
    output = min(demand.max_tokens, policy.expected_output_tokens)
    needed = np.ceil((uncached + output) / block_size)
    safe_total = np.where(total > 0, total, 1.0)
    after = np.where(total > 0, (table.col("free") - table.col("blocks") - needed) / safe_total, 0.0)
    queue = queued(table)

    stale = stale_rows(table, now)
    full = ~stale & queues_full(table, queue, policy, demand.light)
    no_kv = ~stale & ~full & (after < policy.kv_reserve_fraction)
    no_batch = ~stale & ~full & ~no_kv
    if demand.priority is Priority.BATCH:
        slots = table.col("slots")
        load = table.col("running") + queue
        no_slot = (slots > 0) & (load >= slots * (1 - policy.batch_headroom_fraction))
        no_batch &= (after < policy.batch_headroom_fraction) | no_slot
    else:
        no_batch &= False
    fit = ~(stale | full | no_kv | no_batch)
    if not fit.any():
        counts = Counter(
            {
                "not ready or stale": int(stale.sum()),
                "queue full": int(full.sum()),
                "not enough free KV blocks": int(no_kv.sum()),
                "no headroom left for batch": int(no_batch.sum()),
            }
        )
        return Decision(None, reason=counts.most_common(1)[0][0])

    busy = ~stale & ~fit
    if policy.objective == "latency":
        return by_latency(table, matched, demand, now, policy, rng, fit, busy, needed, adapter_held, explain)
    if busy.any():
        size = int(block_size[0])
        if waits_for_affinity(int(matched[fit].max()), int(matched[busy].max()), size, demand, policy):
            return Decision(None, reason=AFFINITY_REASON)

    prompt_blocks = len(demand.block_hashes)
    terms = Candidates(
        prefix_ratio=matched / prompt_blocks if prompt_blocks else np.zeros(len(table)),
        headroom=after,
        queue=queue,
        queue_lo=float(queue[fit].min()),
        queue_hi=float(queue[fit].max()),
        adapter_held=np.ones(len(table)) if demand.adapter is None or adapter_held is None else adapter_held,
    )
    score = np.where(fit, weighted_sum(terms, policy.weights), -np.inf)
    best = score.max()
    winners = np.flatnonzero(score >= best - 1e-9)
    i = int(winners[rng.randrange(len(winners))])
    if not explain:
        return Decision(table.ids[i], int(matched[i]), int(needed[i]))
    j = runner_up(score, i, higher=True)
    second = None if j is None else table.ids[j]
    return Decision(
        table.ids[i], int(matched[i]), int(needed[i]), score=float(score[i]),
        runner_up=second, runner_up_score=math.nan if j is None else float(score[j]),
    )  # fmt: skip


def runner_up(score: Floats, chosen: int, *, higher: bool) -> int | None:
    """The row with the best finite score after `chosen` (None when no other row has one). Pure."""
    others = score.copy() if higher else -score
    others[chosen] = -np.inf
    j = int(np.argmax(others))
    return j if np.isfinite(others[j]) else None


def predicted_columns(
    table: WorkerTable, uncached: Floats, now: float, policy: PlacementPolicy, adapter_s: Floats | float = 0.0
) -> tuple[Floats, Floats]:
    """The latency model over every row: (uncorrected TTFT, ITL of its running requests after), in
    seconds, for a request with `uncached` tokens to compute on each (`placement.predicted_row`)."""
    rate, step = table.col("rate"), table.col("step")
    load, slots = table.col("running") + queued(table), table.col("slots")
    wait = slot_wait_s(load, slots, table.col("completed"), table.latency.request_s)
    raw = predicted_ttft(uncached, table.work_at(now), rate, step, table.latency.chunk_tokens, wait)
    raw = raw + adapter_s
    return raw, itl_after(uncached, rate, step, policy.expected_output_tokens)


def by_latency(
    table: WorkerTable,
    matched: Floats,
    demand: Demand,
    now: float,
    policy: PlacementPolicy,
    rng: random.Random,
    fit: npt.NDArray[np.bool_],
    busy: npt.NDArray[np.bool_],
    needed: Floats,
    adapter_held: Floats | None,
    explain: bool = False,
) -> Decision:
    """`choose_fast` with the latency objective (`placement.choose_by_latency`)."""
    uncached = np.maximum(1.0, demand.prompt_tokens - matched * table.col("block_size"))
    adapter_s: Floats | float = 0.0
    if demand.adapter is not None and adapter_held is not None:
        adapter_s = (1.0 - adapter_held) * policy.latency.adapter_load_s
    raw, itl = predicted_columns(table, uncached, now, policy, adapter_s)
    correction = table.col("correction")
    rate, step, chunk = table.col("rate"), table.col("step"), table.latency.chunk_tokens
    alone = (predicted_ttft(uncached, 0.0, rate, step, chunk) + adapter_s) * correction
    stall = prefill_s(uncached, rate, step, chunk) * (table.col("running") + queued(table))
    held = None
    if demand.adapter is not None and adapter_held is not None:  # placement.adapter_ready
        slots, in_use = table.col("adapter_slots"), table.col("adapters_in_use")
        held = (adapter_held > 0) | (slots == 0) | (in_use < slots)
    i, reason = latency_choice(raw * correction, itl, fit, busy, demand, policy, rng, alone, stall, held)
    if i is None:
        return Decision(None, reason=reason, refused=reason == SHED_REASON)
    if not explain:
        return Decision(table.ids[i], int(matched[i]), int(needed[i]), "", float(raw[i]), int(uncached[i]))
    predicted = np.where(fit, raw * correction, np.inf)
    j = runner_up(predicted, i, higher=False)
    return Decision(
        table.ids[i], int(matched[i]), int(needed[i]), "", float(raw[i]), int(uncached[i]),
        score=float(predicted[i]), runner_up=None if j is None else table.ids[j],
        runner_up_score=math.nan if j is None else float(predicted[j]),
    )  # fmt: skip


def choose_over(
    workers: Sequence[WorkerSnapshot], demand: Demand, now: float, policy: PlacementPolicy, rng: random.Random
) -> Decision:
    """`choose_fast` over snapshots (a table built for this decision): what the dispatcher runs, for a
    caller holding snapshots, such as the simulator's decode-side placement."""
    table = WorkerTable(max(1, len(workers)), policy.latency)
    for w in workers:
        table.upsert(w.heartbeat, w.in_flight, w.in_flight_blocks, w.in_flight_tokens)
    matched = np.array([float(w.matched_blocks) for w in workers])
    held = None
    if demand.adapter is not None:
        held = np.array([1.0 if demand.adapter in w.heartbeat.adapters else 0.0 for w in workers])
    return choose_fast(table, matched, demand, now, policy, rng, held)
