"""The bounded hold of requests waiting for a worker. Pure bookkeeping.

Order: priority class first (interactive before batch); within a class, the team that has been served
the fewest tokens goes first (a virtual token counter, so one team's flood cannot starve the others);
within a team, arrival order. A team that shows up after being idle starts level with the least-served
active team, not at zero, so an idle spell does not buy it a burst.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from queue_schemas.messages import InferenceRequest, Priority

PRIORITY_ORDER = (Priority.INTERACTIVE, Priority.BATCH)


@dataclass(eq=False)
class Held:
    request: InferenceRequest
    partition: tuple[str, int] | None  # (topic, partition) it came from; None if moved off a lost worker
    offset: int | None
    arrived: float
    moved_from: str | None = None
    order: int = field(default=0)
    not_before: float = 0.0  # epoch seconds; a rate-limited batch request waits until then
    reserved: bool = False  # its quota is reserved (batch requests reserve when a worker is found)
    taken_over: InferenceRequest | None = None  # moved: the request as it was on the lost worker

    @property
    def cost(self) -> int:
        return len(self.request.prompt_token_ids) + self.request.sampling.max_tokens


class Hold:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queues: dict[Priority, dict[str, list[Held]]] = {p: {} for p in PRIORITY_ORDER}
        self._served: dict[str, float] = {}
        self._by_id: dict[str, Held] = {}
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def full(self) -> bool:
        return len(self._by_id) >= self.capacity

    def full_for(self, priority: Priority, capacity: int) -> bool:
        """Whether one class holds `capacity` requests or more (a batch flood has its own bound)."""
        return self.size(priority) >= capacity

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def size(self, priority: Priority) -> int:
        return sum(len(q) for q in self._queues[priority].values())

    def add(self, held: Held) -> bool:
        """Hold a request; False if one with the same id is already held (a duplicate delivery)."""
        rid = held.request.request_id
        if rid in self._by_id:
            return False
        held.order = next(self._counter)
        team = held.request.team
        teams = self._queues[held.request.priority]
        if team not in teams:
            active = [self._served.get(t, 0.0) for q in self._queues.values() for t in q]
            floor = min(active) if active else 0.0
            self._served[team] = max(self._served.get(team, 0.0), floor)
            teams[team] = []
        teams[team].append(held)
        self._by_id[rid] = held
        return True

    def remove(self, request_id: str) -> Held | None:
        held = self._by_id.pop(request_id, None)
        if held is None:
            return None
        teams = self._queues[held.request.priority]
        queue = teams[held.request.team]
        queue.remove(held)
        if not queue:
            del teams[held.request.team]
        return held

    def charge(self, team: str, tokens: int) -> None:
        """Count tokens served to a team once its request is placed."""
        self._served[team] = self._served.get(team, 0.0) + tokens

    def ordered(self) -> Iterator[Held]:
        """Held requests in the order they should be offered to workers."""
        for priority in PRIORITY_ORDER:
            teams = self._queues[priority]
            by_team = sorted(teams, key=lambda t: (self._served.get(t, 0.0), teams[t][0].order))
            # Round-robin the teams in served order, so each team's head comes before any team's second.
            for round_ in itertools.zip_longest(*(teams[t] for t in by_team)):
                yield from (h for h in round_ if h is not None)

    def expired(self, now: float) -> list[Held]:
        return [h for h in self._by_id.values() if now > h.request.start_deadline()]

    def from_partitions(self, partitions: set[tuple[str, int]]) -> list[Held]:
        return [h for h in self._by_id.values() if h.partition in partitions]

    def all(self) -> list[Held]:
        return list(self._by_id.values())
