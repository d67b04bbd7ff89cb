"""The dispatcher's live view of one pool: heartbeats, each worker's prefix index, and recent placements."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis
import structlog

from dispatcher.disagg import PrefillSide
from dispatcher.placement import Decision, Demand, PlacementPolicy, WorkerSnapshot
from dispatcher.prefix_index import ApproximateIndex, BlockHolders, PreciseIndex
from dispatcher.scorers import Floats
from dispatcher.table import WorkerTable, choose_fast
from plumbing.clients import xread_any
from plumbing.latency import LatencyDefaults
from plumbing.state import read_heartbeats
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import Heartbeat, KvEvent, KvSnapshot
from queue_schemas.names import Names

log = structlog.get_logger("sluice.dispatcher.view")


class WorkerView:
    def __init__(
        self, redis: aioredis.Redis, names: Names, pool: str, latency: LatencyDefaults | None = None
    ) -> None:
        self._redis = redis
        self._names = names
        self.pool = pool
        self.heartbeats: dict[str, Heartbeat] = {}
        self.precise: dict[str, PreciseIndex] = {}
        self._cursors: dict[str, str] = {}
        self.approximate: dict[str, ApproximateIndex] = {}
        # (when, KV blocks, uncached prompt tokens) of each placement or prefill job since a heartbeat
        self._placed: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
        self.holders = BlockHolders()
        self.table = WorkerTable(latency=latency)
        self._imprecise_cache: list[str] | None = None
        self._slots_cache: tuple[tuple[int, int], npt.NDArray[np.intp]] | None = None

    # heartbeats
    async def refresh(self) -> list[str]:
        """Re-read every heartbeat of the pool; return the workers whose heartbeat expired."""
        beats, gone = await read_heartbeats(self._redis, self._names, self.pool)
        live = {hb.worker_id for hb in beats}
        for worker_id in list(self.heartbeats):
            if worker_id not in live:
                self.forget(worker_id)
        for hb in beats:
            self.on_heartbeat(hb)
        return gone

    def on_heartbeat(self, hb: Heartbeat) -> None:
        current = self.heartbeats.get(hb.worker_id)
        if current is not None and hb.sent_at < current.sent_at:
            return
        self.heartbeats[hb.worker_id] = hb
        self._imprecise_cache = None
        # What was placed before this heartbeat is in its counts now; only later placements are in flight.
        placed = self._placed[hb.worker_id]
        placed[:] = [p for p in placed if p[0] > hb.sent_at]
        if hb.role == "prefill":  # runs prefill jobs only: never a request's placement
            self.table.remove(hb.worker_id)
            return
        self.table.upsert(hb, len(placed), sum(p[1] for p in placed), sum(p[2] for p in placed))

    def forget(self, worker_id: str) -> None:
        self._imprecise_cache = None
        index = self.precise.pop(worker_id, None)
        if index is not None:
            index.drop()
        self.table.remove(worker_id)
        for table in (self.heartbeats, self._cursors, self.approximate, self._placed):
            table.pop(worker_id, None)

    # placement inputs
    def snapshot(self, block_hashes: Sequence[str]) -> list[WorkerSnapshot]:
        """The workers a request may be placed on (prefill-only workers are not among them)."""
        out = []
        for worker_id, hb in self.heartbeats.items():
            if hb.role == "prefill":
                continue
            placed = self._placed[worker_id]
            out.append(
                WorkerSnapshot(
                    hb,
                    in_flight=len(placed),
                    in_flight_blocks=sum(p[1] for p in placed),
                    matched_blocks=self.matched(worker_id, block_hashes),
                    in_flight_tokens=sum(p[2] for p in placed),
                )
            )
        return out

    def waiting(self, worker_id: str) -> int:
        """Requests waiting at the worker: its last heartbeat's, plus what was placed on it since."""
        hb = self.heartbeats.get(worker_id)
        if hb is None:
            return 0
        since = sum(1 for p in self._placed[worker_id] if p[0] > hb.sent_at)
        return hb.waiting + hb.inbox_pending + since

    def prefill_work(self, worker_id: str, now: float) -> int:
        """Uncached prompt tokens queued at a worker now, as the latency model counts them."""
        row = self.table.row.get(worker_id)
        return 0 if row is None else round(float(self.table.work_at(now)[row]))

    def prefill_sides(self, block_hashes: Sequence[str]) -> list[PrefillSide]:
        """The pool's prefill workers, with the prompt tokens sent to each since its heartbeat and how
        much of this prompt each holds."""
        out = []
        for worker_id, hb in self.heartbeats.items():
            if hb.role != "prefill":
                continue
            sent = sum(p[2] for p in self._placed[worker_id] if p[0] > hb.sent_at)
            matched = self.matched(worker_id, block_hashes) * hb.block_size
            out.append(PrefillSide(hb, sent, matched))
        return out

    def record_prefill(self, worker_id: str, tokens: int, block_hashes: Sequence[str]) -> None:
        """Count a prefill job's tokens at its worker until the next heartbeat; it now holds the prefix."""
        self._placed[worker_id].append((time.time(), 0, tokens))
        self._remember_prefix(worker_id, block_hashes)

    def matched(self, worker_id: str, block_hashes: Sequence[str]) -> int:
        hb = self.heartbeats.get(worker_id)
        index = self.precise.get(worker_id)
        if hb is not None and hb.kv_events and index is not None and index.in_sync:
            return index.matched(block_hashes)
        approx = self.approximate.get(worker_id)
        return approx.matched(block_hashes) if approx is not None else 0

    def decide(
        self, demand: Demand, now: float, policy: PlacementPolicy, rng: random.Random, explain: bool = False
    ) -> Decision:
        """The scored placement (placement.choose's rules) over the columnar table; `explain`: with the
        chosen worker's score and the runner-up."""
        matched = self.matched_column(demand.block_hashes)
        held = None if demand.adapter is None else self.adapter_column(demand.adapter)
        return choose_fast(self.table, matched, demand, now, policy, rng, held, explain)

    def adapter_column(self, adapter: str) -> Floats:
        """1 for each table row whose worker's last heartbeat says it holds the adapter."""
        column = np.zeros(len(self.table))
        for row, worker_id in enumerate(self.table.ids):
            hb = self.heartbeats.get(worker_id)
            if hb is not None and adapter in hb.adapters:
                column[row] = 1.0
        return column

    def matched_column(self, block_hashes: Sequence[str]) -> Floats:
        """Each table row's prefix match: precise indexes in one walk, approximate ones per worker."""
        if not block_hashes:
            return np.zeros(len(self.table))
        # One zero past the holders' slots stands for rows whose worker holds nothing.
        depths = np.append(self.holders.depths(block_hashes), 0.0)
        column = depths[self._slot_of_rows()]
        rows = self.table.row
        for worker_id in self._imprecise():
            approx = self.approximate.get(worker_id)
            row = rows.get(worker_id)
            if approx is not None and row is not None:
                column[row] = approx.matched(block_hashes)
        return column

    def _slot_of_rows(self) -> npt.NDArray[np.intp]:
        """Each table row's slot in the block holders (their width for a worker holding nothing), kept
        until a row or a slot moves."""
        key = (self.table.layout, self.holders.layout)
        if self._slots_cache is None or self._slots_cache[0] != key:
            width = self.holders.width
            slots = [self.holders.slot(worker_id) for worker_id in self.table.ids]
            index = np.array([width if s is None else s for s in slots], dtype=np.intp)
            self._slots_cache = (key, index)
        return self._slots_cache[1]

    def _imprecise(self) -> list[str]:
        """Workers without a usable precise index (recomputed only after heartbeats or index changes)."""
        if self._imprecise_cache is None:
            self._imprecise_cache = [
                worker_id
                for worker_id, hb in self.heartbeats.items()
                if not (hb.kv_events and worker_id in self.precise and self.precise[worker_id].in_sync)
            ]
        return self._imprecise_cache

    def record_placement(
        self, worker_id: str, blocks: int, block_hashes: Sequence[str], tokens: int = 0
    ) -> None:
        """Count the placement (its KV blocks, its uncached prompt tokens) as in flight until the next
        heartbeat, and remember its prefix."""
        now = time.time()
        self._placed[worker_id].append((now, blocks, tokens))
        self.table.add_in_flight(worker_id, blocks, tokens, now)
        self._remember_prefix(worker_id, block_hashes)

    def _remember_prefix(self, worker_id: str, block_hashes: Sequence[str]) -> None:
        """The worker holds this prompt now, as far as the approximate index can tell."""
        hb = self.heartbeats.get(worker_id)
        if worker_id not in self.approximate:
            self.approximate[worker_id] = ApproximateIndex(hb.kv_blocks_total if hb else 1024)
        self.approximate[worker_id].record(block_hashes)

    # precise prefix index
    async def read_kv_events(self, block_ms: int) -> int:
        """Apply new KvEvents of every worker that publishes them; resync any worker with a gap."""
        streams: dict[str, str] = {}
        worker_of: dict[str, str] = {}
        for worker_id, hb in self.heartbeats.items():
            if hb.kv_events:
                if worker_id not in self.precise:
                    self.precise[worker_id] = PreciseIndex(worker_id, self.holders)
                key = self._names.kv_index(worker_id)
                streams[key] = self._cursors.get(worker_id, "0")
                worker_of[key] = worker_id
        if not streams:
            return 0
        reply = await xread_any(self._redis, streams, count=2000, block_ms=block_ms)
        if reply:
            self._imprecise_cache = None  # an index may have gone out of (or back into) sync
        applied = 0
        for stream, entries in _stream_entries(reply):
            worker_id = worker_of.get(stream, "")
            index = self.precise.get(worker_id)
            if index is None:
                continue
            for entry_id, fields in entries:
                self._cursors[worker_id] = entry_id
                try:
                    event = decode(KvEvent, fields.get(b"m", b""))
                except SchemaError as exc:
                    log.warning("bad kv event", worker=worker_id, reason=str(exc))
                    continue
                if not index.apply(event):
                    await self._resync(worker_id, index)
                    break
                applied += 1
        return applied

    async def _resync(self, worker_id: str, index: PreciseIndex) -> None:
        """Load the worker's snapshot, then re-read the retained events after it."""
        raw = await self._redis.get(self._names.kv_snapshot(worker_id))
        if raw is None or self.precise.get(worker_id) is not index:
            return  # none, or the worker was forgotten meanwhile: its blocks must not come back
        try:
            index.load(decode(KvSnapshot, raw))
        except SchemaError as exc:
            log.warning("bad kv snapshot", worker=worker_id, reason=str(exc))
            return
        self._cursors[worker_id] = "0"
        log.info("prefix index resynced", worker=worker_id, seq=index.seq)


def _stream_entries(reply: list[Any]) -> list[tuple[str, list[tuple[str, dict[bytes, bytes]]]]]:
    """XREAD's (stream, entries) pairs as (stream name, [(entry id, fields)])."""
    out = []
    for stream, entries in reply:
        name = stream.decode() if isinstance(stream, bytes) else str(stream)
        out.append((name, [(_id(entry_id), fields or {}) for entry_id, fields in entries]))
    return out


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
