"""Which requests the simulated engine runs, as vLLM's scheduler decides it. Pure bookkeeping.

A request runs when a sequence slot is free and the KV blocks of what it holds (prompt and output so
far, plus the next token) fit. Waiting requests are taken in order: by engine priority (lower first),
then arrival, under the `priority` policy; by arrival under `fcfs`. A running request that needs a new
block when none is free preempts a running one: under `priority` the one of the lowest priority, the
latest arrival among equals; under `fcfs` the one admitted last. A preempted request frees its blocks and
waits again; re-admitted, it computes its prompt and its output so far again (vLLM's recompute
preemption), and goes on from where it was.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["priority", "fcfs"]


@dataclass(eq=False)
class Entry:
    priority: int  # engine priority: lower runs first
    tokens: int  # tokens whose KV it holds once running: prompt, plus output so far
    order: int = 0  # arrival
    blocks: int = 0
    running: bool = False
    preempted: int = 0  # times it was preempted
    admitted_at: int = field(default=0, repr=False)  # admission order, for fcfs preemption


class EngineSchedule:
    def __init__(self, slots: int, kv_blocks: int, block_size: int, policy: Policy) -> None:
        self.slots = slots
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.policy = policy
        self.free_blocks = kv_blocks
        self.running: list[Entry] = []
        self._waiting: list[tuple[tuple[int, int], Entry]] = []  # heap
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self.preemptions = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _key(self, entry: Entry) -> tuple[int, int]:
        return (entry.priority, entry.order) if self.policy == "priority" else (0, entry.order)

    def submit(self, entry: Entry) -> list[Entry]:
        """A new request waits; returns the requests this admits (possibly it)."""
        entry.order = next(self._arrivals)
        heapq.heappush(self._waiting, (self._key(entry), entry))
        return self.admit()

    def admit(self) -> list[Entry]:
        """Start waiting requests, in order, while a slot and their blocks are free; returns them."""
        started = []
        while self._waiting and len(self.running) < self.slots:
            entry = self._waiting[0][1]
            need = self.blocks_for(entry.tokens + 1)
            if need > self.free_blocks and self.running:
                break  # vLLM does not preempt to admit; it waits for blocks to free
            heapq.heappop(self._waiting)
            entry.blocks = min(need, self.free_blocks)
            self.free_blocks -= entry.blocks
            entry.running = True
            entry.admitted_at = next(self._admissions)
            self.running.append(entry)
            started.append(entry)
        return started

    def grow(self, entry: Entry, tokens: int) -> list[Entry]:
        """The running `entry` now holds `tokens` tokens; take the blocks that needs, preempting others
        (or, if it is the one to go, itself) while none are free. Returns the preempted requests."""
        entry.tokens = tokens
        preempted = []
        while entry.running and self.blocks_for(tokens) > entry.blocks:
            if self.free_blocks > 0:
                self.free_blocks -= 1
                entry.blocks += 1
                continue
            victim = self._victim()
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _victim(self) -> Entry:
        if self.policy == "priority":
            return max(self.running, key=lambda e: (e.priority, e.order))
        return max(self.running, key=lambda e: e.admitted_at)

    def _preempt(self, victim: Entry) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.running = False
        victim.preempted += 1
        self.preemptions += 1
        heapq.heappush(self._waiting, (self._key(victim), victim))

    def finish(self, entry: Entry) -> list[Entry]:
        """The request is done or aborted; returns the requests its blocks and slot admit."""
        if entry.running:
            self.running.remove(entry)
            self.free_blocks += entry.blocks
            entry.blocks = 0
            entry.running = False
        else:
            self._waiting = [(k, e) for k, e in self._waiting if e is not entry]
            heapq.heapify(self._waiting)
        return self.admit()
