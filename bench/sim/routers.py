"""Placement policies the fleet simulator compares.

`sluice` runs the project's own placement (`dispatcher.table.choose_fast`, the dispatcher's fast path)
on what the dispatcher sees: heartbeats every half second plus its own placements since. It may answer
"no worker fits now"; the request then waits in the hold, as in the live dispatcher.

The baselines follow their published descriptions (see ../shared/ANCHORS.md for the sources) and read
each replica's state as it is at the moment of the decision, which is at least as good as what their
gateways see. Each gets the precise prefix match of every replica where it uses one.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from bench.sim.engine import Replica, Request
from dispatcher.placement import Demand, PlacementPolicy
from dispatcher.table import WorkerTable, choose_fast
from queue_schemas.messages import Heartbeat, Priority, WorkerState


class Router(Protocol):
    name: str

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None: ...

    def on_heartbeat(self, replica: Replica, now: float) -> None: ...


def heartbeat(replica: Replica, now: float, seq: int) -> Heartbeat:
    m = replica.model
    state = WorkerState.DRAINING if replica.draining else WorkerState.READY
    return Heartbeat.model_construct(
        worker_id=f"r{replica.index}", pool="sim", model="llama-70b", state=state, seq=seq, sent_at=now,
        ttl_ms=3000, kv_blocks_total=m.kv_blocks, kv_blocks_free=max(0, replica.free_blocks),
        block_size=m.block_size, running=len(replica.running) + len(replica.prefilling),
        waiting=len(replica.waiting), inbox_pending=0, max_running=m.max_seqs, decode_tokens_per_s=0.0,
        started_at=replica.ready_at, ready_at=replica.ready_at, completed_per_s=0.0,
    )  # fmt: skip


def least_loaded(replicas: Sequence[Replica], rng: random.Random) -> Replica:
    """A replica with the fewest requests in the system, chosen at random among equals."""
    low = min(r.in_system for r in replicas)
    return rng.choice([r for r in replicas if r.in_system == low])


class Stateless:
    """Base for the baselines: nothing to learn from heartbeats."""

    name = "stateless"

    def on_heartbeat(self, replica: Replica, now: float) -> None:
        return None


class SluiceRouter:
    name = "sluice"

    def __init__(self, policy: PlacementPolicy, rng: random.Random) -> None:
        self.policy = policy
        self.rng = rng
        self.table = WorkerTable()
        self._seq = 0
        self.decision_s = 0.0
        self.decisions = 0

    def on_heartbeat(self, replica: Replica, now: float) -> None:
        self._seq += 1
        self.table.upsert(heartbeat(replica, now, self._seq), 0, 0)

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        by_id = {f"r{r.index}": r for r in replicas}
        for worker_id in [w for w in self.table.ids if w not in by_id]:
            self.table.remove(worker_id)
        if not len(self.table):
            return None
        matched = np.array([by_id[w].matched(request.blocks) for w in self.table.ids], dtype=float)
        priority = Priority.BATCH if request.priority == "batch" else Priority.INTERACTIVE
        demand = Demand(request.prompt_tokens, request.blocks, request.output_tokens, priority)
        t0 = time.perf_counter()
        decision = choose_fast(self.table, matched, demand, now, self.policy, self.rng)
        self.decision_s += time.perf_counter() - t0
        self.decisions += 1
        if decision.worker_id is None:
            return None
        self.table.add_in_flight(decision.worker_id, decision.blocks_needed)
        return by_id[decision.worker_id]


class RandomRouter(Stateless):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        return self.rng.choice(replicas) if replicas else None


class RoundRobinRouter(Stateless):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        if not replicas:
            return None
        self.next += 1
        return replicas[self.next % len(replicas)]


class LeastLoadedRouter(Stateless):
    name = "least-loaded"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        return least_loaded(replicas, self.rng) if replicas else None


class SglangRouter(Stateless):
    """SGLang gateway, cache-aware: balance when load is skewed, else follow the best prefix match."""

    name = "sglang"

    def __init__(self, rng: random.Random, threshold: float = 0.5, abs_thr: int = 32, rel_thr: float = 1.1):
        self.rng = rng
        self.threshold, self.abs_thr, self.rel_thr = threshold, abs_thr, rel_thr

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        if not replicas:
            return None
        loads = [r.in_system for r in replicas]
        lo, hi = min(loads), max(loads)
        lowest = least_loaded(replicas, self.rng)
        if hi - lo > self.abs_thr and hi > self.rel_thr * lo:
            return lowest
        blocks = max(1, len(request.blocks))
        ratios = [r.matched(request.blocks) / blocks for r in replicas]
        best = max(ratios)
        if best > self.threshold:
            return self.rng.choice([r for r, m in zip(replicas, ratios, strict=True) if m == best])
        return lowest


class LlmdRouter(Stateless):
    """llm-d's default scorers (prefix 3, KV utilisation 2, queue 2) after its saturation filter."""

    name = "llm-d"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        if not replicas:
            return None
        usage = [1 - r.free_blocks / r.model.kv_blocks for r in replicas]
        fit = [r for r, u in zip(replicas, usage, strict=True) if max(r.queue / 5, u / 0.8) < 1] or list(
            replicas
        )
        queues = [r.queue for r in fit]
        lo, hi = min(queues), max(queues)
        blocks = max(1, len(request.blocks))
        best, chosen = -math.inf, []
        for r in fit:
            prefix = r.matched(request.blocks) / blocks
            kv = r.free_blocks / r.model.kv_blocks
            queue = 1.0 if hi == lo else (hi - r.queue) / (hi - lo)
            s = 3 * prefix + 2 * max(0.0, min(1.0, kv)) + 2 * queue
            if s > best + 1e-9:
                best, chosen = s, [r]
            elif s >= best - 1e-9:
                chosen.append(r)
        return self.rng.choice(chosen)


class DynamoRouter(Stateless):
    """NVIDIA Dynamo's KV router: least cost = new prefill blocks (queued plus this prompt's uncached)
    plus the blocks of running sequences."""

    name = "dynamo"

    def __init__(self, rng: random.Random, prefill_load_scale: float = 1.0) -> None:
        self.rng = rng
        self.scale = prefill_load_scale

    def route(self, request: Request, replicas: Sequence[Replica], now: float) -> Replica | None:
        if not replicas:
            return None
        best, chosen = math.inf, []
        prompt_blocks = len(request.blocks)
        for r in replicas:
            new = max(0, r.prefill_blocks() + prompt_blocks - r.matched(request.blocks))
            cost = self.scale * new + r.decode_blocks()
            if cost < best - 1e-9:
                best, chosen = cost, [r]
            elif cost <= best + 1e-9:
                chosen.append(r)
        return self.rng.choice(chosen)


def make_router(name: str, seed: int, policy: PlacementPolicy | None = None) -> Router:
    rng = random.Random(seed)
    routers: dict[str, Router] = {
        "sluice": SluiceRouter(policy or PlacementPolicy(), rng),
        "random": RandomRouter(rng),
        "round-robin": RoundRobinRouter(),
        "least-loaded": LeastLoadedRouter(rng),
        "sglang": SglangRouter(rng),
        "llm-d": LlmdRouter(rng),
        "dynamo": DynamoRouter(rng),
    }
    return routers[name]


ROUTERS = ("sluice", "random", "round-robin", "least-loaded", "sglang", "llm-d", "dynamo")
