"""What waits and runs at one worker, and which waiting entry a free slot takes. Pure: no I/O; the worker's
inbox loop (gpu_workers.consuming) asks it and tells it what started and ended."""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict

from gpu_workers.presence import Ready, next_light, next_to_start
from queue_schemas.messages import InferenceRequest, Priority

RECENT_REQUESTS = 4096  # request ids a worker remembers having run, to drop an entry appended twice


class Slots:
    def __init__(self, max_running: int, light_slots: int, batch_slots: int) -> None:
        self.max_running = max_running
        self.light_slots = light_slots  # the engine runs max_running + light_slots (see next_light)
        self.batch_slots = batch_slots
        # Entries read from the inbox and not started yet: a slot that frees takes the best of them
        # (`next_to_start`), not the oldest. They stay unacknowledged in the inbox, so a dispatcher
        # recovers them with the running ones if this worker is lost.
        self.ready: list[Ready] = []
        self._arrivals = itertools.count()
        self._team_of: dict[str, str] = {}  # request id -> team, of the requests running here
        self._by_team: Counter[str] = Counter()
        self._batch: set[str] = set()  # request ids of the batch requests running here
        self._adapter_of: dict[str, str] = {}  # request id -> LoRA adapter, of those running here
        self._by_adapter: Counter[str] = Counter()
        self._finished: OrderedDict[str, None] = OrderedDict()  # recent request ids, oldest first

    def knows(self, request_id: str) -> bool:
        """Whether the request waits here or ran here lately (an entry appended again is not run twice)."""
        return request_id in self._team_of or any(r.request.request_id == request_id for r in self.ready)

    def finished(self, request_id: str) -> bool:
        return request_id in self._finished

    def wait(self, request: InferenceRequest, entry_id: bytes) -> None:
        self.ready.append(Ready(request, entry_id, next(self._arrivals)))

    def next(self, running: int) -> Ready | None:
        """The entry the next free slot takes, out of the waiting ones, with `running` requests running: a
        stated slot takes the best (`next_to_start`; a batch entry only while batch holds fewer than
        `batch_slots`), a light slot only an interactive entry of a team under its share (`next_light`)."""
        if not self.ready:
            return None
        if running < self.max_running:
            room = len(self._batch) < self.batch_slots
            chosen: int | None = next_to_start(self.ready, self._by_team, room)
        elif running < self.max_running + self.light_slots:
            chosen = next_light(self.ready, self._by_team, self.max_running)
        else:
            chosen = None
        return None if chosen is None else self.ready.pop(chosen)

    def adapters_in_use(self) -> int:
        """Distinct LoRA adapters of the requests running here."""
        return len(self._by_adapter)

    def started(self, request: InferenceRequest) -> None:
        self._team_of[request.request_id] = request.team
        if request.adapter is not None:
            self._adapter_of[request.request_id] = request.adapter
            self._by_adapter[request.adapter] += 1
        if request.priority is Priority.BATCH:
            self._batch.add(request.request_id)
        self._by_team[request.team] += 1

    def ended(self, request_id: str) -> None:
        self._batch.discard(request_id)
        adapter = self._adapter_of.pop(request_id, None)
        if adapter is not None:
            self._by_adapter[adapter] -= 1
            if not self._by_adapter[adapter]:
                del self._by_adapter[adapter]
        team = self._team_of.pop(request_id, None)
        if team is None:
            return
        self._finished[request_id] = None
        if len(self._finished) > RECENT_REQUESTS:
            self._finished.popitem(last=False)
        self._by_team[team] -= 1
        if not self._by_team[team]:
            del self._by_team[team]
