"""A worker's presence in its pool: the heartbeat it publishes, the state file probes read, and leaving.

`heartbeat` is pure: it turns what the worker knows of itself and its engine into the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gpu_workers.engine import EngineStats
from gpu_workers.inbox import Inbox
from gpu_workers.settings import WorkerSettings
from gpu_workers.starting import FAILED_HEARTBEAT_TTL_MS
from queue_schemas.messages import Heartbeat, InferenceRequest, Priority, WorkerState

log = structlog.get_logger("sluice.worker")

MIN_HEARTBEAT_GAP_S = 0.05
STALE_ROUNDS = 5  # rounds a loop may miss before /healthz calls it stuck
STALE_FLOOR_S = 10.0  # and never sooner: a busy event loop or a slow Redis reply delays a round


@dataclass(frozen=True)
class Vitals:
    """The worker's own state, as of one heartbeat."""

    state: WorkerState
    started_at: float
    load_seconds: float | None
    ready_at: float | None
    error: str | None
    max_running: int
    tensor_parallel_size: int
    light_slots: int = 0


class CompletionRate:
    """Requests finished per second over a trailing window."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)

    def rate(self, now: float) -> float:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times) / self.window_s


@dataclass(frozen=True)
class Ready:
    """An inbox entry read and not started yet."""

    request: InferenceRequest
    entry_id: bytes
    arrival: int  # the order it was read in


def batch_slots(max_running: int, headroom: float) -> int:
    """How many of a worker's slots batch requests may hold at once: what the batch headroom leaves,
    at least one. The dispatchers place by the same rule; the worker holds to it as well, since two
    dispatchers placing between two heartbeats can each fill the same room. Pure."""
    return max(1, math.floor(max_running * (1 - headroom) + 1e-9))


def next_to_start(
    ready: Sequence[Ready], running_by_team: Mapping[str, int], batch_room: bool = True
) -> int | None:
    """Which of the ready entries a free slot takes (its index), if any: the lowest band (interactive
    tiers, then batch, and batch only while `batch_room`); within it, the team with the fewest requests
    running on this worker, so a team that holds its slots does not also take the next one from a team
    that holds none; then the lowest fair tag (the dispatcher's order), then the order read. Pure."""
    candidates = [
        i for i in range(len(ready)) if batch_room or ready[i].request.priority is Priority.INTERACTIVE
    ]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda i: (
            ready[i].request.band,
            running_by_team.get(ready[i].request.team, 0),
            ready[i].request.fair_tag,
            ready[i].arrival,
        ),
    )


def under_share(team: str, running_by_team: Mapping[str, int], slots: int) -> bool:
    """Whether a team runs fewer than an equal share of the worker's slots among the teams running on
    it, itself counted. Pure."""
    teams = len(running_by_team) + (team not in running_by_team)
    return running_by_team.get(team, 0) * teams < slots


def next_light(ready: Sequence[Ready], running_by_team: Mapping[str, int], slots: int) -> int | None:
    """Which ready entry a light slot takes, if any: an interactive one whose team is under its share of
    the worker's `slots` (the best of those by `next_to_start`'s order), so a team that holds few slots
    starts at once beside a team that fills them. Pure."""
    eligible = [
        i
        for i, r in enumerate(ready)
        if r.request.priority is Priority.INTERACTIVE and under_share(r.request.team, running_by_team, slots)
    ]
    chosen = next_to_start([ready[i] for i in eligible], running_by_team)
    return None if chosen is None else eligible[chosen]


def engine_load(stats: EngineStats, handed: int) -> EngineStats:
    """The engine's figures with its running count at least what the worker has handed it and it does
    not report waiting: an engine's statistics trail its step (vLLM's by a step or more), and a request
    counted neither there nor in the inbox would let a dispatcher place past the worker's slots."""
    return dataclasses.replace(stats, running=max(stats.running, handed - stats.waiting))


def heartbeat(
    settings: WorkerSettings,
    model: str,
    vitals: Vitals,
    stats: EngineStats,
    inbox_pending: int,
    *,
    seq: int,
    kv_seq: int,
    completed_per_s: float,
) -> Heartbeat:
    failed = vitals.state is WorkerState.FAILED
    return Heartbeat(
        worker_id=settings.worker_id,
        pool=settings.pool,
        model=model,
        state=vitals.state,
        seq=seq,
        sent_at=time.time(),
        ttl_ms=FAILED_HEARTBEAT_TTL_MS if failed else settings.heartbeat_ttl_ms,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_free=stats.kv_blocks_free,
        block_size=stats.block_size,
        running=stats.running,
        waiting=stats.waiting,
        inbox_pending=inbox_pending,
        max_running=vitals.max_running,
        light_slots=vitals.light_slots,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        role=settings.role,
        started_at=vitals.started_at,
        load_seconds=vitals.load_seconds,
        kv_events=True,
        kv_index_seq=kv_seq,
        spec_decoding=settings.spec_decoding,
        ready_at=vitals.ready_at,
        completed_per_s=completed_per_s,
        tensor_parallel_size=vitals.tensor_parallel_size,
        prefix_query_tokens=stats.prefix_query_tokens,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        preemptions=stats.preemptions,
        adapters=stats.adapters,
        adapter_slots=stats.adapter_slots,
        error=vitals.error,
    )


def state_on_drain_request(state: WorkerState, asked: bool) -> WorkerState:
    """A ready worker drains while the scaler asks it to (its readiness probe fails, so the cluster
    removes this pod first when it lowers the replica count), and is ready again once the request is
    withdrawn or expires. Pure; a worker draining to exit never comes here."""
    if state not in (WorkerState.READY, WorkerState.DRAINING):
        return state
    return WorkerState.DRAINING if asked else WorkerState.READY


def stale_after_s(interval_s: float) -> float:
    """How long a loop that makes a round every `interval_s` may go without one before it counts as
    stuck. Pure."""
    return max(STALE_ROUNDS * interval_s, STALE_FLOOR_S)


async def beat_forever(
    publish: Callable[[], Awaitable[None]], interval_s: float, soon: asyncio.Event
) -> None:
    """A heartbeat every interval, and one soon after `soon` is set (a request ended; at most every
    MIN_HEARTBEAT_GAP_S), so dispatchers see freed slots before the next regular one."""
    while True:
        soon.clear()
        sent = time.monotonic()
        try:
            await publish()
        except RedisError as exc:
            log.warning("heartbeat failed", error=str(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(soon.wait(), interval_s)
        await asyncio.sleep(max(0.0, MIN_HEARTBEAT_GAP_S - (time.monotonic() - sent)))


def write_state_file(path: Path, state: str) -> None:
    """The worker's state for a readiness probe (`grep -qx ready FILE`), replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(state + "\n")
    tmp.replace(path)


async def leave_pool(redis: aioredis.Redis, settings: WorkerSettings, inbox: Inbox, *, failed: bool) -> None:
    """Leave the pool. Entries still in the inbox stay there with our membership, and the missing
    heartbeat makes a dispatcher take them over at once. A failed worker leaves its `failed` heartbeat
    and membership for ops to see; dispatchers treat it as gone and clean up after it."""
    names, worker = settings.names, settings.worker_id
    with contextlib.suppress(RedisError):
        left = await inbox.length()
        async with redis.pipeline(transaction=False) as pipe:
            if not failed:
                pipe.delete(names.heartbeat(settings.pool, worker))
            if not left and not failed:
                pipe.srem(names.workers(settings.pool), worker)
                pipe.delete(names.kv_index(worker), names.kv_snapshot(worker))
            await pipe.execute()
        if left:
            log.warning("left unfinished entries for a dispatcher to take over", entries=left)
    log.info("worker stopped", worker=worker)
