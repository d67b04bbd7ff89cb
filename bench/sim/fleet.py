"""The fleet simulator's event loop: arrivals, replica events, heartbeats, the hold and the scaler.

Discrete events on one heap. A replica posts its next event (a prompt done, a sequence done) whenever its
state changes; a stale one is recognised by the replica's version and skipped. Heartbeats go out for every
live replica each `heartbeat_s` (or as often as the router refreshes, `refresh_s`). Routers read views of
the replicas (views.py): the replicas themselves (`exact`) or their last report plus the router's own
placements since (`heartbeat`). A router that counts its own requests in flight (`finished`) is told of
each request that ends, as a gateway sees a response end, and one that learns from first tokens
(`first_token`) of each first token, as a gateway sees a stream's first chunk. A scaler's target is
applied at once: a lower one cancels replicas still starting, then drains ready ones, those with the
fewest requests first, as a ReplicaSet scales down. A request a router holds waits in the hold,
interactive ahead of batch and in arrival order within each (a router with `fair_hold`, sluice's, orders
it as the dispatcher's hold does: `dispatcher.hold.FairQueue`, teams by tokens served within a band),
and the hold is retried (at most `max_misses` failures in a row) after every heartbeat round, every
replica start and every finished request, for every router alike.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from bench.sim.engine import Replica, Request, TimingModel
from bench.sim.metrics import Stats
from bench.sim.routers import Router
from bench.sim.views import Mode, ReplicaView, Snapshot
from dispatcher.hold import FairQueue
from gpu_workers.presence import CompletionRate


@dataclass
class FleetState:
    """What a scaler sees at one tick."""

    now: float
    arrived: int
    backlog: int  # requests not yet started: the hold plus what waits inside replicas
    ready: list[Replica]
    starting: int
    draining: int
    completed_recent: dict[int, float]  # completions per second over the last 10 s, per ready replica
    prefill_tokens: int = 0  # prompt tokens not yet prefilled: held, waiting and in prefill
    ttft_mean: float = math.nan  # mean time to first token of the requests finished since the last tick
    held: int = 0  # requests in the hold: read from Kafka and not yet placed
    # The consumer group's lag: the dispatcher commits a partition up to its oldest record not yet
    # placed, so every request that arrived since the oldest held one is lag (one partition: the most).
    lag: int = 0
    # What a router's per-worker gauges show: the last request to reach its first token on each replica
    # (prompt tokens, TTFT s), and the mean ITL of the last one to finish there.
    first_tokens: dict[int, tuple[int, float]] = field(default_factory=dict)
    itls: dict[int, float] = field(default_factory=dict)


class SimHold:
    """Requests a router could not place yet. `fair`: the dispatcher's order (FairQueue, a request's team
    is its tenant); otherwise interactive ahead of batch, each in arrival order."""

    def __init__(self, fair: bool) -> None:
        self.fair = fair
        self._classes: dict[str, deque[Request]] = {"interactive": deque(), "batch": deque()}
        self._order: FairQueue[Request] = FairQueue()
        self._count = {"interactive": 0, "batch": 0}
        self.prompt_tokens = 0  # of every held request, kept as requests come and go
        self._arrivals: list[tuple[float, int]] = []  # heap of (arrival, entry) of requests held
        self._entries: dict[int, int] = {}  # a held request's entry in that heap, by request id
        self._gone: set[int] = set()  # entries of requests no longer held, still in the heap
        self._next_entry = itertools.count()

    def __len__(self) -> int:
        return self._count["interactive"] + self._count["batch"]

    def blocks(self, request: Request) -> bool:
        """Whether something held goes before the new request (it then waits its turn in the hold)."""
        return bool(self._count["interactive"] or (request.priority == "batch" and self._count["batch"]))

    def oldest_arrival(self) -> float:
        """The arrival time of the longest-held request (inf with none held)."""
        while self._arrivals and self._arrivals[0][1] in self._gone:
            self._gone.discard(heapq.heappop(self._arrivals)[1])
        return self._arrivals[0][0] if self._arrivals else math.inf

    def _left(self, request: Request) -> None:
        self._count[request.priority] -= 1
        self.prompt_tokens -= request.prompt_tokens
        self._gone.add(self._entries.pop(request.rid))

    def add(self, request: Request) -> None:
        self.prompt_tokens += request.prompt_tokens
        entry = self._entries[request.rid] = next(self._next_entry)
        heapq.heappush(self._arrivals, (request.arrival, entry))
        self._count[request.priority] += 1
        if self.fair:
            self._order.add(request, request.band, str(request.tenant))
        else:
            self._classes[request.priority].append(request)  # behind those of its class already waiting

    def retry(self, place: Callable[[Request], bool], max_misses: int) -> None:
        """Offer held requests in order; stop after `max_misses` failures in a row (the failed ones keep
        their places)."""
        misses = 0
        if self.fair:
            placed = []
            for request in self._order.ordered():
                if misses >= max_misses:
                    break
                if place(request):
                    placed.append(request)
                    misses = 0
                else:
                    misses += 1
            for request in placed:
                self._order.remove(request, request.band, str(request.tenant))
                self._order.charge(str(request.tenant), request.prompt_tokens + request.max_tokens)
                self._left(request)
            return
        for priority in ("interactive", "batch"):
            queue = self._classes[priority]
            failed: list[Request] = []
            while queue and misses < max_misses:
                request = queue.popleft()
                if place(request):
                    misses = 0
                    self._left(request)
                else:
                    failed.append(request)
                    misses += 1
            queue.extendleft(reversed(failed))


class Scaler(Protocol):
    name: str
    interval_s: float

    def target(self, state: FleetState) -> int:
        """Replicas wanted (ready + starting) after this tick."""
        ...


@dataclass
class Outcome:
    stats: Stats
    replica_seconds: float
    timeline: list[tuple[float, int, int, int]] = field(
        default_factory=list
    )  # (t, ready, starting, draining)
    unfinished: int = 0
    hold_peak: int = 0


ARRIVAL, EVENT, BEAT, SCALE, READY = range(5)


class Fleet:
    def __init__(
        self,
        router: Router,
        model: TimingModel,
        replicas: int,
        *,
        heartbeat_s: float = 0.5,
        scaler: Scaler | None = None,
        startup_s: float = 180.0,
        max_misses: int = 16,
        views: Mode = "heartbeat",
        by_minute: bool = False,
        sink: list[Request] | None = None,
        split_at: float | None = None,
    ) -> None:
        self.router = router
        self.sink = sink
        self.mode = views
        self.model = model
        refresh_s = getattr(router, "refresh_s", None) if views == "heartbeat" else None
        self.heartbeat_s = refresh_s or heartbeat_s  # a router that scrapes more often refreshes so
        self.scaler = scaler
        self.startup_s = startup_s
        self.max_misses = max_misses
        self.live: list[Replica] = [Replica(i, model) for i in range(replicas)]
        self.views: dict[int, ReplicaView] = {r.index: self._view_of(r) for r in self.live}
        self._ids = itertools.count(replicas)
        self._launched: dict[int, float] = {}
        self._by_index: dict[int, Replica] = {}
        self.starting = 0
        self.hold = SimHold(fair=getattr(router, "fair_hold", False))
        self._heap: list[tuple[float, int, int, int]] = []
        self._tie = itertools.count()
        self.arrived = 0
        self.stats = Stats(minutes={} if by_minute else None, split_at=split_at)
        self.replica_seconds = 0.0
        self._last_t = 0.0
        self.timeline: list[tuple[float, int, int, int]] = []
        self.hold_peak = 0
        self._completions: dict[int, CompletionRate] = {}  # what the scaler reads, by replica
        self._ttft_sum, self._ttft_count = 0.0, 0
        self._first_tokens: dict[int, tuple[int, float]] = {}
        self._itls: dict[int, float] = {}
        self._arrival_times: list[float] = []

    # heap
    def _push(self, t: float, kind: int, arg: int = 0) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._tie), arg))

    def _view_of(self, replica: Replica) -> ReplicaView:
        return replica if self.mode == "exact" else Snapshot.of(replica)

    def _post(self, replica: Replica) -> None:
        """Schedule the replica's next event under its current version (each `place` and `process`
        changes the version, so an event posted before is then recognised as stale)."""
        t = replica.next_event()
        if t < math.inf:
            self._push(t, EVENT, replica.index * 1_000_000 + replica.version % 1_000_000)

    def run(self, arrivals: Iterator[Request], until: float, drain_s: float = 600.0) -> Outcome:
        by_index = self._by_index = {r.index: r for r in self.live}
        pending = next(arrivals, None)
        if pending is not None:
            self._push(pending.arrival, ARRIVAL)
        self._push(0.0, BEAT)
        if self.scaler is not None:
            self._push(0.0, SCALE)
        end = until + drain_s
        while self._heap:
            t, kind, _, arg = heapq.heappop(self._heap)
            if t > end:
                break
            self._account(t)
            if kind == ARRIVAL and pending is not None:
                self.arrived += 1
                self._arrival_times.append(pending.arrival)
                self._offer(pending, t)
                pending = next(arrivals, None)
                if pending is not None:
                    self._push(pending.arrival, ARRIVAL)
            elif kind == EVENT:
                replica = by_index.get(arg // 1_000_000)
                if replica is None or replica.version % 1_000_000 != arg % 1_000_000:
                    continue
                finished = replica.process(t)
                started = getattr(self.router, "first_token", None)
                for request in replica.started:
                    if started is not None:
                        started(request, t)
                    self._first_tokens[replica.index] = (
                        request.prompt_tokens,
                        request.first_token - request.arrival,
                    )
                replica.started.clear()
                ended = getattr(self.router, "finished", None)
                for request in finished:
                    if ended is not None:
                        ended(request, t)
                    self.stats.add(request)
                    self._ttft_sum += request.first_token - request.arrival
                    self._ttft_count += 1
                    self._itls[replica.index] = (request.done - request.first_token) / max(
                        1, request.output_tokens - 1
                    )
                    if self.sink is not None:
                        self.sink.append(request)
                    self._completions.setdefault(replica.index, CompletionRate()).record(t)
                self._post(replica)
                if replica.draining and replica.in_system == 0:
                    self._retire(replica, by_index)
                if finished and len(self.hold):
                    self._retry_hold(t)
            elif kind == BEAT:
                if self.mode == "heartbeat":
                    for replica in self.live:
                        view = self.views[replica.index]
                        assert isinstance(view, Snapshot)
                        view.refresh()
                self.router.observe(self._eligible(), t)
                self._retry_hold(t)
                if t < end and (pending is not None or self._busy()):
                    self._push(t + self.heartbeat_s, BEAT)
            elif kind == SCALE and self.scaler is not None:
                self._scale(t, by_index)
                if pending is not None or self._busy():
                    self._push(t + self.scaler.interval_s, SCALE)
            elif kind == READY:
                if arg not in self._launched:
                    continue  # cancelled while it started
                launched = self._launched.pop(arg)
                replica = Replica(arg, self.model, ready_at=t, launched_at=launched, now=t)
                self.starting -= 1
                self.live.append(replica)
                self.views[arg] = self._view_of(replica)
                by_index[arg] = replica
                self.router.observe(self._eligible(), t)
                self._retry_hold(t)
        unfinished = len(self.hold) + sum(r.in_system for r in self.live)
        return Outcome(self.stats, self.replica_seconds, self.timeline, unfinished, self.hold_peak)

    def _busy(self) -> bool:
        return bool(len(self.hold)) or any(r.in_system for r in self.live)

    def _account(self, t: float) -> None:
        self.replica_seconds += (t - self._last_t) * (len(self.live) + self.starting)
        self._last_t = t

    def _eligible(self) -> list[ReplicaView]:
        return [self.views[r.index] for r in self.live if not r.draining]

    def _offer(self, request: Request, t: float) -> None:
        if self.hold.blocks(request) or not self._place_now(request, t):
            self.hold.add(request)
        self.hold_peak = max(self.hold_peak, len(self.hold))

    def _retry_hold(self, t: float) -> None:
        self.hold.retry(lambda request: self._place_now(request, t), self.max_misses)

    def _place_now(self, request: Request, t: float) -> bool:
        views = self._eligible()
        if self.mode == "exact":
            self.router.observe(views, t)  # every decision reads the state of this moment
        view = self.router.route(request, views, t)
        if view is None:
            return False
        if isinstance(view, Snapshot):
            view.placed(request)
        replica = self._by_index[view.index]
        replica.place(request, t)
        self._post(replica)
        return True

    # scaling
    def _scale(self, t: float, by_index: dict[int, Replica]) -> None:
        assert self.scaler is not None
        ready = [r for r in self.live if not r.draining]
        recent = {r.index: self._completions.setdefault(r.index, CompletionRate()).rate(t) for r in ready}
        draining = sum(1 for r in self.live if r.draining)
        held = len(self.hold)
        backlog = held + sum(r.queue for r in ready)
        prefill = self.hold.prompt_tokens + sum(r.prefill_tokens() for r in ready)
        ttft = self._ttft_sum / self._ttft_count if self._ttft_count else math.nan
        self._ttft_sum, self._ttft_count = 0.0, 0
        lag = 0
        if held:
            oldest = self.hold.oldest_arrival()
            lag = self.arrived - bisect.bisect_left(self._arrival_times, oldest)
        state = FleetState(
            t, self.arrived, backlog, ready, self.starting, draining, recent, prefill, ttft, held, lag,
            self._first_tokens, self._itls,
        )  # fmt: skip
        target = self.scaler.target(state)
        current = len(ready) + self.starting
        for _ in range(max(0, target - current)):
            self.starting += 1
            index = next(self._ids)
            self._launched[index] = t
            self._push(t + self.startup_s, READY, index)
        # As a ReplicaSet scales down: pods still starting go first (the latest launched), then the
        # ready ones with the fewest requests.
        surplus = max(0, current - target)
        for index in sorted(self._launched, key=self._launched.__getitem__, reverse=True)[:surplus]:
            del self._launched[index]  # its READY event finds it gone
            self.starting -= 1
            surplus -= 1
        for victim in sorted(ready, key=lambda r: r.in_system)[:surplus]:
            victim.draining = True
            if victim.in_system == 0:
                self._retire(victim, by_index)
        self.timeline.append((t, len(self._eligible()), self.starting, draining))

    def _retire(self, replica: Replica, by_index: dict[int, Replica]) -> None:
        self.live.remove(replica)
        by_index.pop(replica.index, None)
        self.views.pop(replica.index, None)


def simulate(
    router_factory: Callable[[], Router],
    model: TimingModel,
    requests: Callable[[random.Random], Iterator[Request]],
    duration_s: float,
    replicas: int,
    seed: int = 1,
    scaler: Scaler | None = None,
    startup_s: float = 180.0,
    heartbeat_s: float = 0.5,
    views: Mode = "heartbeat",
    by_minute: bool = False,
    sink: list[Request] | None = None,
    split_at: float | None = None,
) -> Outcome:
    fleet = Fleet(
        router_factory(), model, replicas, scaler=scaler, startup_s=startup_s, heartbeat_s=heartbeat_s,
        views=views, by_minute=by_minute, sink=sink, split_at=split_at,
    )  # fmt: skip
    return fleet.run(requests(random.Random(seed)), duration_s)
