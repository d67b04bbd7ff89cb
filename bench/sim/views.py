"""What a router knows about a replica: the replica itself ("exact now"), or its last report ("heartbeat").

Every router in the simulator gets the same kind of view, so none sees more than another:

- `exact`: the replica's state at the moment of the decision, and its prefix cache as it is.
- `heartbeat`: the replica's state and prefix cache as its last report showed them (reports every
  `heartbeat_s`, so up to that old), plus what this router placed on it since. The cache is a copy that
  replays the replica's inserts at each report, so it is exactly the cache of that moment.

Both kinds answer the same questions (`ReplicaView`): the figures vLLM exports (waiting, running, KV
usage) and what a gateway can count itself (requests in the system, prefill tokens it routed). A router
refreshes its views as often as its design does: sluice at each heartbeat, llm-d's endpoint picker at
each metrics scrape (`refresh_s`, 50 ms). Whatever the views, a prefix index fed by the engines' KV
events (sluice's, llm-d's precise one, Dynamo's) is current to the millisecond: `indexed` reads the
replica's cache as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from bench.sim.engine import Replica, Request, TimingModel, leading_cached
from gpu_workers.prefix_cache import PrefixCache

Mode = Literal["exact", "heartbeat"]


class ReplicaView(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def model(self) -> TimingModel: ...

    @property
    def in_system(self) -> int: ...

    @property
    def queue(self) -> int: ...

    @property
    def scheduled(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def completed_per_s(self) -> float: ...

    @property
    def cache_size(self) -> int: ...

    def prefill_tokens(self) -> int: ...

    def prefill_blocks(self) -> int: ...

    def decode_blocks(self) -> int: ...

    def matched(self, blocks: tuple[str, ...]) -> int: ...

    def indexed(self, blocks: tuple[str, ...]) -> int:
        """The prefix match by an index fed by the replica's KV events (current, whatever the view)."""
        ...

    def held_adapters(self) -> frozenset[int]: ...

    def active_adapters(self) -> frozenset[int]: ...

    def waiting_adapters(self) -> frozenset[int]: ...


@dataclass(eq=False)
class Snapshot:
    """A replica as its last heartbeat reported it, plus the router's own placements since."""

    replica: Replica
    published: PrefixCache
    in_system: int = 0
    queue: int = 0
    scheduled: int = 0
    free_blocks: int = 0
    completed_per_s: float = 0.0
    _prefill_tokens: int = 0
    _decode_blocks: int = 0
    _held: frozenset[int] = frozenset()
    _active: frozenset[int] = frozenset()
    _waiting: frozenset[int] = frozenset()

    @classmethod
    def of(cls, replica: Replica) -> Snapshot:
        replica.cache_log = []
        published = PrefixCache(replica.model.kv_blocks)
        for h in reversed(replica.cache.hashes()):  # least recent first, so the LRU order carries over
            published.insert((h,))
        view = cls(replica, published)
        view.refresh()
        return view

    @property
    def index(self) -> int:
        return self.replica.index

    @property
    def model(self) -> TimingModel:
        return self.replica.model

    @property
    def cache_size(self) -> int:
        return len(self.published)

    def refresh(self) -> None:
        """Take the replica's report: its figures now, and its cache after the inserts since the last."""
        r = self.replica
        assert r.cache_log is not None
        for capacity, blocks in r.cache_log:
            self.published.capacity = capacity
            self.published.insert(blocks)
        r.cache_log.clear()
        self.in_system, self.queue, self.scheduled = r.in_system, r.queue, r.scheduled
        self.free_blocks = r.free_blocks
        self.completed_per_s = r.completed_per_s
        self._prefill_tokens, self._decode_blocks = r.prefill_tokens(), r.decode_blocks()
        if r.model.max_loras:
            self._held, self._active, self._waiting = (
                r.held_adapters(),
                r.active_adapters(),
                r.waiting_adapters(),
            )

    def placed(self, request: Request) -> None:
        """Count a placement this router made since the report, as a gateway counts its own: one more
        request waiting, its uncached prompt to prefill and its blocks (an engine allocates a prompt's
        blocks when it admits it, its output's as it generates), its adapter among the waiting ones."""
        m = self.model
        uncached = max(1, request.prompt_tokens - self.indexed(request.blocks) * m.block_size)
        self.in_system += 1
        self.queue += 1
        self._prefill_tokens += uncached
        self.free_blocks -= math.ceil(uncached / m.block_size)
        if request.adapter >= 0:
            self._waiting = self._waiting | {request.adapter}

    def prefill_tokens(self) -> int:
        return self._prefill_tokens

    def prefill_blocks(self) -> int:
        return math.ceil(self._prefill_tokens / self.model.block_size)

    def decode_blocks(self) -> int:
        return self._decode_blocks

    def matched(self, blocks: tuple[str, ...]) -> int:
        return leading_cached(self.published, blocks)

    def indexed(self, blocks: tuple[str, ...]) -> int:
        return self.replica.matched(blocks)

    def held_adapters(self) -> frozenset[int]:
        return self._held

    def active_adapters(self) -> frozenset[int]:
        return self._active

    def waiting_adapters(self) -> frozenset[int]:
        return self._waiting
