"""Which offset of each partition is safe to commit. Pure bookkeeping.

A record is open from when it is read until it is placed, answered, dead-lettered or dropped. The safe
commit for a partition is its lowest open offset, or one past the last record read when none is open,
so a restart redelivers every record that was not finished and none that was.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)  # a partition: its number, or (topic, number) for several topics


class OffsetTracker(Generic[P]):
    def __init__(self) -> None:
        self._open: dict[P, set[int]] = {}
        self._next: dict[P, int] = {}
        self._committed: dict[P, int] = {}

    def opened(self, partition: P, offset: int) -> None:
        self._open.setdefault(partition, set()).add(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def closed(self, partition: P, offset: int) -> None:
        self._open.get(partition, set()).discard(offset)

    def safe(self, partition: P) -> int | None:
        if partition not in self._next:
            return None
        pending = self._open.get(partition)
        return min(pending) if pending else self._next[partition]

    def to_commit(self) -> dict[P, int]:
        """Partitions whose safe offset moved since the last commit, with that offset."""
        out = {}
        for partition in self._next:
            offset = self.safe(partition)
            if offset is not None and offset != self._committed.get(partition):
                out[partition] = offset
        return out

    def committed(self, offsets: dict[P, int]) -> None:
        self._committed.update(offsets)

    def forget(self, partitions: set[P]) -> None:
        """Partitions this consumer no longer owns (after a rebalance)."""
        for p in partitions:
            self._open.pop(p, None)
            self._next.pop(p, None)
            self._committed.pop(p, None)
