"""An LRU cache of prefix blocks by chain hash. Pure bookkeeping: it reports what it stored and evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._blocks

    def hashes(self) -> list[str]:
        return list(self._blocks)

    def match(self, block_hashes: Sequence[str]) -> int:
        """How many leading blocks are cached (chain hashes: a match at i implies the whole prefix)."""
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, block_hashes: Sequence[str]) -> tuple[list[str], list[str]]:
        """Mark the blocks most recently used, adding missing ones; return (stored, evicted).

        The first block ends up the most recently used and the last the least, as when an engine frees
        a finished request's blocks tail first: eviction then trims prefixes from their end, and a
        cached prefix stays usable for as long as possible.
        """
        stored: list[str] = []
        blocks, refresh = self._blocks, self._blocks.move_to_end
        for h in reversed(block_hashes):
            try:
                refresh(h)  # the common case: a shared prefix already cached
            except KeyError:
                blocks[h] = None
                stored.append(h)
        stored.reverse()
        evicted: list[str] = []
        while len(self._blocks) > self.capacity:
            victim, _ = self._blocks.popitem(last=False)
            evicted.append(victim)
        # A block stored and evicted in the same call never existed for consumers.
        gone, new = set(evicted), set(stored)
        return [h for h in stored if h not in gone], [h for h in evicted if h not in new]

    def clear(self) -> None:
        self._blocks.clear()
