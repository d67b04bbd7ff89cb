"""The dispatcher's live view of one pool: heartbeats, each worker's prefix index, and recent placements."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
import structlog

from dispatcher.placement import WorkerSnapshot
from dispatcher.prefix_index import ApproximateIndex, PreciseIndex
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import Heartbeat, KvEvent, KvSnapshot
from queue_schemas.names import Names
from queue_schemas.state import read_heartbeats

log = structlog.get_logger("sluice.dispatcher.view")


class WorkerView:
    def __init__(self, redis: aioredis.Redis, names: Names, pool: str) -> None:
        self._redis = redis
        self._names = names
        self.pool = pool
        self.heartbeats: dict[str, Heartbeat] = {}
        self.precise: dict[str, PreciseIndex] = {}
        self._cursors: dict[str, str] = {}
        self.approximate: dict[str, ApproximateIndex] = {}
        self._placed: dict[str, list[tuple[float, int]]] = defaultdict(list)

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
        if current is None or hb.sent_at >= current.sent_at:
            self.heartbeats[hb.worker_id] = hb

    def forget(self, worker_id: str) -> None:
        for table in (self.heartbeats, self.precise, self._cursors, self.approximate, self._placed):
            table.pop(worker_id, None)

    # placement inputs
    def snapshot(self, block_hashes: Sequence[str]) -> list[WorkerSnapshot]:
        out = []
        for worker_id, hb in self.heartbeats.items():
            placed = self._placed[worker_id]
            placed[:] = [(t, b) for t, b in placed if t > hb.sent_at]
            out.append(
                WorkerSnapshot(
                    hb,
                    in_flight=len(placed),
                    in_flight_blocks=sum(b for _, b in placed),
                    matched_blocks=self.matched(worker_id, block_hashes),
                )
            )
        return out

    def matched(self, worker_id: str, block_hashes: Sequence[str]) -> int:
        hb = self.heartbeats.get(worker_id)
        index = self.precise.get(worker_id)
        if hb is not None and hb.kv_events and index is not None and index.in_sync:
            return index.matched(block_hashes)
        approx = self.approximate.get(worker_id)
        return approx.matched(block_hashes) if approx is not None else 0

    def record_placement(self, worker_id: str, blocks: int, block_hashes: Sequence[str]) -> None:
        """Count the placement as in flight until the next heartbeat, and remember its prefix."""
        self._placed[worker_id].append((time.time(), blocks))
        hb = self.heartbeats.get(worker_id)
        if worker_id not in self.approximate:
            self.approximate[worker_id] = ApproximateIndex(hb.kv_blocks_total if hb else 1024)
        self.approximate[worker_id].record(block_hashes)

    # precise prefix index
    async def read_kv_events(self, block_ms: int) -> int:
        """Apply new KvEvents of every worker that publishes them; resync any worker with a gap."""
        streams: dict[Any, Any] = {}
        for worker_id, hb in self.heartbeats.items():
            if hb.kv_events:
                self.precise.setdefault(worker_id, PreciseIndex())
                streams[self._names.kv_index(worker_id)] = self._cursors.get(worker_id, "0")
        if not streams:
            return 0
        reply = await self._redis.xread(streams, count=2000, block=block_ms)
        applied = 0
        for stream, entries in _stream_entries(reply):
            worker_id = stream.rsplit(":", 1)[-1]
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
        if raw is None:
            return
        try:
            index.load(decode(KvSnapshot, raw))
        except SchemaError as exc:
            log.warning("bad kv snapshot", worker=worker_id, reason=str(exc))
            return
        self._cursors[worker_id] = "0"
        log.info("prefix index resynced", worker=worker_id, seq=index.seq)


def _stream_entries(reply: Any) -> list[tuple[str, list[tuple[str, dict[bytes, bytes]]]]]:
    """XREAD's reply as (stream, [(entry id, fields)]), whether it came as RESP2 lists or a RESP3 map."""
    if not reply:
        return []
    items = list(reply.items()) if isinstance(reply, dict) else [(item[0], item[1]) for item in reply]
    out = []
    for stream, entries in items:
        name = stream.decode() if isinstance(stream, bytes) else str(stream)
        out.append((name, [(_id(entry_id), fields or {}) for entry_id, fields in entries]))
    return out


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
