"""The bounded hold of requests waiting for a worker. Pure bookkeeping.

Order: band first, the engine priority of the request (interactive by service tier, priority then
default then flex, and batch last), so the order before the engine and inside it is the same. Within a
band, the team that has been served the fewest weighted tokens goes first (a virtual token counter: a
team's tokens count 1/weight, so one team's flood cannot starve the others, and a team of weight 2 gets
twice the share of a team of weight 1 while both wait); within a team, arrival order. A team that shows
up after being idle starts level with the least-served active team, not at zero, so an idle spell does
not buy it a burst; on a tie the team with fewer requests waiting goes first.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pydantic import ValidationError

from queue_schemas.messages import BATCH_ENGINE_PRIORITY, ENGINE_PRIORITY, InferenceRequest, Priority
from queue_schemas.teams import TeamRecord

BANDS = (*sorted(ENGINE_PRIORITY.values()), BATCH_ENGINE_PRIORITY)
T = TypeVar("T")


@dataclass(eq=False)
class Held:
    request: InferenceRequest
    partition: tuple[str, int] | None  # (topic, partition) it came from; None if moved off a lost worker
    offset: int | None
    arrived: float
    moved_from: str | None = None
    band: int = field(default=0)  # its band when it joined the hold (its request may be rewritten since)
    not_before: float = 0.0  # epoch seconds; a rate-limited batch request waits until then
    reserved: bool = False  # its quota is reserved (batch requests reserve when a worker is found)
    taken_over: InferenceRequest | None = None  # moved: the request as it was on the lost worker
    produced_at: float | None = None  # epoch seconds its record was produced, where known (tracing)
    waited_for: str = ""  # why it last stayed in the hold (tracing)
    traced_to: float = 0.0  # epoch seconds its spans cover up to (tracing)
    traceparent: str | None = None  # the span it came with (the request's own, when not given)

    def __post_init__(self) -> None:
        if self.traceparent is None:
            self.traceparent = self.request.traceparent

    @property
    def cost(self) -> int:
        return len(self.request.prompt_token_ids) + self.request.sampling.max_tokens


class FairQueue(Generic[T]):
    """The hold's order over any kind of item (the dispatcher's held requests, the simulator's requests):
    bands in BANDS order; within a band, teams by weighted tokens served, round-robin; within a team,
    arrival order."""

    def __init__(self) -> None:
        self._queues: dict[int, dict[str, deque[tuple[int, T]]]] = {band: {} for band in BANDS}
        self._served: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._counter = itertools.count()

    def teams(self) -> set[str]:
        return {t for q in self._queues.values() for t in q}

    def set_weights(self, weights: dict[str, float]) -> None:
        """Teams' weights (1 for a team not named); they apply to tokens charged from now on."""
        self._weights = {t: w for t, w in weights.items() if w > 0}

    def add(self, item: T, band: int, team: str) -> None:
        teams = self._queues[band]
        if team not in teams:
            # A team that was idle starts level with the least-served active team.
            active = [self._served.get(t, 0.0) for q in self._queues.values() for t in q]
            floor = min(active) if active else 0.0
            self._served[team] = max(self._served.get(team, 0.0), floor)
            teams[team] = deque()
        teams[team].append((next(self._counter), item))

    def remove(self, item: T, band: int, team: str) -> None:
        teams = self._queues[band]
        queue = teams[team]
        for i, (_, queued) in enumerate(queue):
            if queued is item:
                del queue[i]
                break
        if not queue:
            del teams[team]

    def charge(self, team: str, tokens: int) -> None:
        """Count tokens served to a team once its request is placed, scaled by 1/weight."""
        self._served[team] = self._served.get(team, 0.0) + tokens / self._weights.get(team, 1.0)

    def _teams_in_order(self, band: int) -> list[str]:
        teams = self._queues[band]
        # On equal tokens served (a team back from idle starts level), the team with less waiting first.
        return sorted(teams, key=lambda t: (self._served.get(t, 0.0), len(teams[t]), teams[t][0][0]))

    def tag(self, team: str) -> int:
        """The team's weighted tokens served so far: a request placed now carries it as its fair tag, so
        the engine keeps the same order among the requests queued there (start-time fair queueing)."""
        return int(self._served.get(team, 0.0))

    def ordered(self) -> Iterator[T]:
        """Items in the order they should be offered to workers. Lazy: take what a round needs, and
        change the queue (remove, charge) only after the round."""
        for band in BANDS:
            teams = self._queues[band]
            by_team = self._teams_in_order(band)
            # Round-robin the teams in served order, so each team's head comes before any team's second.
            for round_ in itertools.zip_longest(*(teams[t] for t in by_team)):
                yield from (entry[1] for entry in round_ if entry is not None)


class Hold:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: FairQueue[Held] = FairQueue()
        self._by_id: dict[str, Held] = {}
        self._sizes: Counter[Priority] = Counter()  # kept as requests come and go: read every round
        self._by_team: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def full(self) -> bool:
        return len(self._by_id) >= self.capacity

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def size(self, priority: Priority) -> int:
        return self._sizes[priority]

    def held_of(self, team: str) -> int:
        return self._by_team[team]

    def held_by_team(self) -> dict[str, int]:
        return {team: n for team, n in self._by_team.items() if n}

    def teams(self) -> set[str]:
        return self._order.teams()

    def set_weights(self, weights: dict[str, float]) -> None:
        self._order.set_weights(weights)

    def add(self, held: Held) -> bool:
        """Hold a request; False if one with the same id is already held (a duplicate delivery)."""
        rid = held.request.request_id
        if rid in self._by_id:
            return False
        held.band = held.request.band
        self._order.add(held, held.band, held.request.team)
        self._by_id[rid] = held
        self._sizes[held.request.priority] += 1
        self._by_team[held.request.team] += 1
        return True

    def holds_record(self, request_id: str, partition: tuple[str, int] | None, offset: int | None) -> bool:
        """Whether the request is held from this very record: a record delivered again (the consumer's
        position was reset by a reassignment) must not close the offset its held copy keeps open."""
        held = self._by_id.get(request_id)
        return held is not None and (held.partition, held.offset) == (partition, offset)

    def remove(self, request_id: str) -> Held | None:
        held = self._by_id.pop(request_id, None)
        if held is not None:
            self._order.remove(held, held.band, held.request.team)
            self._sizes[held.request.priority] -= 1
            self._by_team[held.request.team] -= 1
            if not self._by_team[held.request.team]:
                del self._by_team[held.request.team]
        return held

    def charge(self, team: str, tokens: int) -> None:
        self._order.charge(team, tokens)

    def ordered(self) -> Iterator[Held]:
        """Held requests in the order they should be offered to workers."""
        return self._order.ordered()

    def tag(self, team: str) -> int:
        return self._order.tag(team)

    def expired(self, now: float) -> list[Held]:
        return [h for h in self._by_id.values() if now > h.request.start_deadline()]

    def from_partitions(self, partitions: set[tuple[str, int]]) -> list[Held]:
        return [h for h in self._by_id.values() if h.partition in partitions]

    def all(self) -> list[Held]:
        return list(self._by_id.values())


def team_weights(teams: Sequence[str], records: Sequence[bytes | str | None]) -> dict[str, float]:
    """Weights from the teams' stored records (None where a team has none, or its record is unreadable:
    such a team weighs 1)."""
    weights: dict[str, float] = {}
    for team, raw in zip(teams, records, strict=True):
        if raw is None:
            continue
        try:
            weights[team] = TeamRecord.model_validate_json(raw).weight
        except ValidationError:
            continue
    return weights
