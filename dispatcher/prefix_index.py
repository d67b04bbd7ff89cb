"""Which prefix blocks each worker holds, as the dispatcher knows it. Pure bookkeeping.

PreciseIndex is rebuilt from a worker's KvEvents (and snapshots, after a gap). ApproximateIndex is the
fallback for workers that publish no events: it remembers what this dispatcher placed where, LRU-bounded
by the worker's KV capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from queue_schemas.messages import KvEvent, KvEventKind, KvSnapshot


def leading_matches(held: Collection[str], block_hashes: Sequence[str]) -> int:
    """Blocks of the prompt held from its start on; chain hashes make the first miss the end."""
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    return n


class PreciseIndex:
    """One worker's blocks, mirrored into `holders` (if given) whenever the index is in sync."""

    def __init__(self, worker_id: str = "", holders: BlockHolders | None = None) -> None:
        self.worker_id = worker_id
        self.holders = holders
        self.seq = 0
        self.blocks: set[str] = set()
        self.in_sync = False

    def apply(self, event: KvEvent) -> bool:
        """Apply one event in order; False means events were missed and a resync is needed."""
        if event.kind is KvEventKind.CLEARED:
            # A clear is a complete state by itself, so it also ends a gap.
            self._replace(set())
            self.seq = event.seq
            self.in_sync = True
            return True
        if self.in_sync and event.seq <= self.seq:
            return True  # already applied (re-read after a resync)
        if not self.in_sync or event.seq != self.seq + 1:
            self.in_sync = False
            self._replace(set())  # an index out of sync must not attract placements
            return False
        if event.kind is KvEventKind.STORED:
            self.blocks.update(event.block_hashes)
            if self.holders is not None:
                self.holders.add(self.worker_id, event.block_hashes)
        else:
            self.blocks.difference_update(event.block_hashes)
            if self.holders is not None:
                self.holders.remove(self.worker_id, event.block_hashes)
        self.seq = event.seq
        return True

    def load(self, snapshot: KvSnapshot) -> None:
        self._replace(set(snapshot.block_hashes))
        self.seq = snapshot.seq
        self.in_sync = True

    def drop(self) -> None:
        """Forget the worker entirely (it left the pool)."""
        self._replace(set())
        self.in_sync = False

    def _replace(self, blocks: set[str]) -> None:
        if self.holders is not None:
            self.holders.remove(self.worker_id, self.blocks)
            self.holders.add(self.worker_id, blocks)
        self.blocks = blocks

    def matched(self, block_hashes: Sequence[str]) -> int:
        return leading_matches(self.blocks, block_hashes) if self.in_sync else 0


class ApproximateIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self._blocks: OrderedDict[str, None] = OrderedDict()

    def record(self, block_hashes: Sequence[str]) -> None:
        for h in block_hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def matched(self, block_hashes: Sequence[str]) -> int:
        return leading_matches(self._blocks, block_hashes)


class BlockHolders:
    """Which workers hold each block: finds every worker's prefix match in one walk down the prompt."""

    def __init__(self) -> None:
        self._by_block: dict[str, set[str]] = {}

    def add(self, worker_id: str, block_hashes: Collection[str]) -> None:
        for h in block_hashes:
            self._by_block.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, block_hashes: Collection[str]) -> None:
        for h in block_hashes:
            holders = self._by_block.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._by_block[h]

    def matched(self, block_hashes: Sequence[str]) -> dict[str, int]:
        """Leading blocks of the prompt each worker holds (workers holding none are left out)."""
        out: dict[str, int] = {}
        alive: set[str] = set()
        depth = 0
        for h in block_hashes:
            holders = self._by_block.get(h)
            if not holders:
                break
            if depth == 0:
                alive = set(holders)
            elif not alive <= holders:  # someone drops out here (the common case is nobody)
                survivors = alive & holders
                for worker_id in alive - survivors:
                    out[worker_id] = depth
                alive = survivors
                if not alive:
                    break
            depth += 1
        for worker_id in alive:
            out[worker_id] = depth
        return out
