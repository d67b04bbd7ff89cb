"""Which LoRA adapters an engine holds: loaded on demand up to a bound, the least recently used evicted.

Pure bookkeeping, no I/O: the simulated engine charges a load for an adapter it does not hold, and
the heartbeat reports what is held so a dispatcher can place a request where its adapter already is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Use:
    """What using an adapter did: whether it had to be loaded, and which adapter that evicted."""

    loaded: bool
    evicted: str | None = None


class AdapterLru:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("an adapter cache holds at least one adapter")
        self.capacity = capacity
        self._held: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def use(self, name: str) -> Use:
        """Mark `name` as just used, loading it (and evicting the least recently used) if not held."""
        if name in self._held:
            self._held.move_to_end(name)
            return Use(loaded=False)
        evicted = None
        if len(self._held) >= self.capacity:
            evicted, _ = self._held.popitem(last=False)
        self._held[name] = None
        return Use(loaded=True, evicted=evicted)

    def held(self) -> tuple[str, ...]:
        """The adapters held, least recently used first."""
        return tuple(self._held)
