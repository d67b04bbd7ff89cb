"""Publishing a worker's prefix-cache changes as a gap-free, sequence-numbered Redis Stream.

Each change becomes a KvEvent on kv:<worker>; a KvSnapshot of every block held is written to
kvsnap:<worker> every `snapshot_every_s`, so a consumer that missed events (or joined late) can resync:
load the snapshot, then apply the retained events with a higher seq. The snapshot is built from the
events themselves (a mirror of what was published), so it always matches its seq exactly.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from gpu_workers.engine import KvChange
from queue_schemas.codec import encode
from queue_schemas.messages import KvEvent, KvEventKind, KvSnapshot
from queue_schemas.names import Names

STREAM_MAX_LEN = 20_000


class KvMirror:
    """The block set consumers will rebuild from the events published so far. Pure."""

    def __init__(self) -> None:
        self.seq = 0
        self.blocks: set[str] = set()

    def apply(self, kind: KvEventKind, hashes: tuple[str, ...]) -> int:
        self.seq += 1
        if kind is KvEventKind.STORED:
            self.blocks.update(hashes)
        elif kind is KvEventKind.REMOVED:
            self.blocks.difference_update(hashes)
        else:
            self.blocks.clear()
        return self.seq


class KvPublisher:
    def __init__(
        self, redis: aioredis.Redis, names: Names, worker_id: str, snapshot_every_s: float = 2.0
    ) -> None:
        self._redis = redis
        self._stream = names.kv_index(worker_id)
        self._snapshot_key = names.kv_snapshot(worker_id)
        self._worker_id = worker_id
        self._snapshot_every_s = snapshot_every_s
        self._snapshot_at = 0.0
        self.mirror = KvMirror()

    @property
    def seq(self) -> int:
        return self.mirror.seq

    async def reset(self) -> None:
        """A new worker incarnation starts from an empty cache: drop old events, announce a clear."""
        await self._redis.delete(self._stream, self._snapshot_key)
        await self.publish([(KvEventKind.CLEARED, ())])

    async def publish(self, changes: list[KvChange]) -> None:
        now = time.monotonic()
        if not changes and now - self._snapshot_at < self._snapshot_every_s:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, hashes in changes:
                seq = self.mirror.apply(kind, hashes)
                event = KvEvent(worker_id=self._worker_id, seq=seq, kind=kind, block_hashes=hashes)
                pipe.xadd(self._stream, {"m": encode(event)}, maxlen=STREAM_MAX_LEN, approximate=True)
            if now - self._snapshot_at >= self._snapshot_every_s:
                snapshot = KvSnapshot(
                    worker_id=self._worker_id,
                    seq=self.mirror.seq,
                    block_hashes=tuple(self.mirror.blocks),
                    taken_at=time.time(),
                )
                pipe.set(self._snapshot_key, encode(snapshot))
                self._snapshot_at = now
            await pipe.execute()
