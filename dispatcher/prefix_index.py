"""Which prefix blocks each worker holds, as the dispatcher knows it. Pure bookkeeping.

PreciseIndex is rebuilt from a worker's KvEvents (and snapshots, after a gap). ApproximateIndex is the
fallback for workers that publish no events: it remembers what this dispatcher placed where, LRU-bounded
by the worker's KV capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

import numpy as np
import numpy.typing as npt

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
    """Which workers hold each block, as a bitmask over worker slots: every worker's prefix match is
    one walk down the prompt with an integer AND per block.

    A worker takes a slot when it first holds a block and gives it back when it holds none, for the
    next worker to take: the masks are as wide as the most workers that have held blocks at once.
    `layout` changes whenever a slot is taken or given back (a caller caching slot positions checks
    it)."""

    def __init__(self) -> None:
        self._by_block: dict[str, int] = {}
        self._slot: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._held: list[int] = []  # blocks each slot holds
        self._free: list[int] = []
        self.layout = 0

    def slot(self, worker_id: str) -> int | None:
        return self._slot.get(worker_id)

    @property
    def width(self) -> int:
        return len(self._ids)

    def add(self, worker_id: str, block_hashes: Collection[str]) -> None:
        if not block_hashes:
            return
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._take(worker_id)
        bit = 1 << slot
        by_block = self._by_block
        added = 0
        for h in block_hashes:
            mask = by_block.get(h, 0)
            if not mask & bit:
                by_block[h] = mask | bit
                added += 1
        self._held[slot] += added
        if not self._held[slot]:
            self._give_back(worker_id, slot)

    def remove(self, worker_id: str, block_hashes: Collection[str]) -> None:
        slot = self._slot.get(worker_id)
        if slot is None:
            return
        bit = 1 << slot
        by_block = self._by_block
        removed = 0
        for h in block_hashes:
            mask = by_block.get(h, 0)
            if mask & bit:
                mask ^= bit
                removed += 1
                if mask:
                    by_block[h] = mask
                else:
                    del by_block[h]
        self._held[slot] -= removed
        if not self._held[slot]:
            self._give_back(worker_id, slot)

    def _take(self, worker_id: str) -> int:
        if self._free:
            slot = self._free.pop()
            self._ids[slot] = worker_id
        else:
            slot = len(self._ids)
            self._ids.append(worker_id)
            self._held.append(0)
        self._slot[worker_id] = slot
        self.layout += 1
        return slot

    def _give_back(self, worker_id: str, slot: int) -> None:
        del self._slot[worker_id]
        self._ids[slot] = None
        self._free.append(slot)
        self.layout += 1

    def depth_groups(self, block_hashes: Sequence[str]) -> list[tuple[int, int]]:
        """(mask of slots, leading blocks held) for each depth at which some workers' match ends; the
        masks are disjoint, and slots in none hold no leading block."""
        by_block = self._by_block
        groups: list[tuple[int, int]] = []
        alive = 0
        depth = 0
        for h in block_hashes:
            mask = by_block.get(h, 0)
            if depth == 0:
                alive = mask
            else:
                survivors = alive & mask
                if survivors != alive:  # someone drops out here (the common case is nobody)
                    groups.append((alive ^ survivors, depth))
                    alive = survivors
            if not alive:
                break
            depth += 1
        if alive:
            groups.append((alive, depth))
        return groups

    def depths(self, block_hashes: Sequence[str]) -> npt.NDArray[np.float64]:
        """Leading blocks of the prompt held, by slot (`width` of them)."""
        width = len(self._ids)
        out = np.zeros(width)
        nbytes = (width + 7) // 8
        for mask, depth in self.depth_groups(block_hashes):
            bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), np.uint8), bitorder="little")
            out[bits[:width].astype(bool)] = depth
        return out

    def matched(self, block_hashes: Sequence[str]) -> dict[str, int]:
        """Leading blocks of the prompt each worker holds (workers holding none are left out)."""
        out: dict[str, int] = {}
        for mask, depth in self.depth_groups(block_hashes):
            while mask:
                low = mask & -mask
                worker_id = self._ids[low.bit_length() - 1]
                if worker_id is not None:
                    out[worker_id] = depth
                mask ^= low
        return out
