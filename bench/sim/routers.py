"""Placement policies the fleet simulator compares.

Every router reads the same `ReplicaView`s (see views.py: the state now, or as of the last heartbeat plus
its own placements since) and the same request fields the live dispatcher has: the prompt's block hashes,
its token count, `max_tokens` and the priority class, never the true output length. A router may answer
None ("hold it"): the request then waits in the fleet's hold (interactive first, first come first served
within a class) and is offered again when a heartbeat arrives, a replica starts or a request finishes.
Only routers whose published design has a gateway-side queue hold: sluice (the dispatcher's hold), llm-d
(flow control) and Dynamo (the router queue). Each baseline's docstring names the source it follows.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

from bench.sim.engine import Request, leading_cached
from bench.sim.views import ReplicaView
from dispatcher.placement import Demand, PlacementPolicy
from dispatcher.scorers import default_weights
from dispatcher.table import WorkerTable, choose_fast
from gpu_workers.prefix_cache import PrefixCache
from queue_schemas.messages import Heartbeat, Priority, WorkerState


class Router(Protocol):
    name: str

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None: ...

    def observe(self, views: Sequence[ReplicaView], now: float) -> None:
        """A report from every replica (at each heartbeat; before every decision with exact views)."""
        ...


def heartbeat(view: ReplicaView, now: float, seq: int) -> Heartbeat:
    m = view.model
    return Heartbeat.model_construct(
        worker_id=f"r{view.index}", pool="sim", model="llama-70b", state=WorkerState.READY, seq=seq,
        sent_at=now, ttl_ms=3000, kv_blocks_total=m.kv_blocks, kv_blocks_free=max(0, view.free_blocks),
        block_size=m.block_size, running=view.scheduled, waiting=view.queue, inbox_pending=0,
        max_running=m.max_seqs, decode_tokens_per_s=0.0, started_at=0.0, ready_at=0.0,
        completed_per_s=view.completed_per_s,
    )  # fmt: skip


def least_loaded(views: Sequence[ReplicaView], rng: random.Random) -> ReplicaView:
    """A replica with the fewest requests in the system, chosen at random among equals."""
    low = min(v.in_system for v in views)
    return rng.choice([v for v in views if v.in_system == low])


def kv_usage(view: ReplicaView) -> float:
    return 1 - view.free_blocks / view.model.kv_blocks


class Stateless:
    """Base for the baselines that keep no table of their own."""

    name = "stateless"

    def observe(self, views: Sequence[ReplicaView], now: float) -> None:
        return None


class SluiceRouter:
    """The project's placement (`dispatcher.table.choose_fast`, the dispatcher's fast path) over a worker
    table filled from the views' reports, with the dispatcher's own placements since added in."""

    name = "sluice"
    fair_hold = True  # the fleet's hold runs the dispatcher's order (dispatcher.hold.FairQueue)

    def __init__(self, policy: PlacementPolicy, rng: random.Random) -> None:
        self.policy = policy
        self.rng = rng
        self.table = WorkerTable()
        self._seq = 0
        self.decision_s = 0.0
        self.decisions = 0

    def _forget_gone(self, live: Collection[str]) -> None:
        for worker_id in [w for w in self.table.ids if w not in live]:
            self.table.remove(worker_id)

    def observe(self, views: Sequence[ReplicaView], now: float) -> None:
        self._forget_gone({f"r{v.index}" for v in views})
        for v in views:
            self._seq += 1
            self.table.upsert(heartbeat(v, now, self._seq), 0, 0)

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        by_id = {f"r{v.index}": v for v in views}
        self._forget_gone(by_id)
        if not len(self.table):
            return None
        matched = np.array([by_id[w].matched(request.blocks) for w in self.table.ids], dtype=float)
        priority = Priority.BATCH if request.priority == "batch" else Priority.INTERACTIVE
        max_tokens = request.max_tokens or self.policy.expected_output_tokens
        adapter = f"a{request.adapter}" if request.adapter >= 0 else None
        demand = Demand(
            request.prompt_tokens,
            request.blocks,
            max_tokens,
            priority,
            now - request.arrival,
            adapter=adapter,
        )
        held = None
        if adapter is not None:
            held = np.array([float(request.adapter in by_id[w].held_adapters()) for w in self.table.ids])
        t0 = time.perf_counter()
        decision = choose_fast(self.table, matched, demand, now, self.policy, self.rng, held)
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

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        return self.rng.choice(views) if views else None


class RoundRobinRouter(Stateless):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        self.next += 1
        return views[self.next % len(views)]


class LeastLoadedRouter(Stateless):
    name = "least-loaded"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        return least_loaded(views, self.rng) if views else None


class SglangRouter(Stateless):
    """SGLang's model gateway (sgl-router), policy `cache_aware`.

    Source: sgl-project/sglang, sgl-router/src/policies/cache_aware.rs and its README. If the load is
    imbalanced (max - min > balance_abs_threshold and max > balance_rel_threshold x min, load being the
    requests the router has in flight per worker) it takes the least loaded worker. Otherwise it takes the
    worker whose radix tree matches the longest share of the request's text if that share exceeds
    cache_threshold, and else the worker with the smallest tree (the one with the most room to cache),
    not the least loaded. Defaults 0.5 / 32 / 1.1 (cache_threshold / abs / rel). Its tree is built from
    what it routed where, at once (`records_placements`): with heartbeat views its placements since the
    last report join the view's cache; the others' indexes are fed by the engines' KV events and see
    the cache as reported.
    """

    name = "sglang"
    records_placements = True

    def __init__(self, rng: random.Random, threshold: float = 0.5, abs_thr: int = 32, rel_thr: float = 1.1):
        self.rng = rng
        self.threshold, self.abs_thr, self.rel_thr = threshold, abs_thr, rel_thr

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        loads = [v.in_system for v in views]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_thr and hi > self.rel_thr * lo:
            return least_loaded(views, self.rng)
        blocks = max(1, len(request.blocks))
        ratios = [v.matched(request.blocks) / blocks for v in views]
        best = max(ratios)
        if best > self.threshold:
            return self.rng.choice([v for v, m in zip(views, ratios, strict=True) if m == best])
        smallest = min(v.cache_size for v in views)
        return self.rng.choice([v for v in views if v.cache_size == smallest])


def lora_affinity(view: ReplicaView, adapter: int) -> float:
    """gateway-api-inference-extension's lora-affinity-scorer, from vLLM's lora_requests_info: 1 where
    the adapter has requests running, 0.8 where running and waiting adapters leave room for one more,
    0.6 where it has requests waiting, else 0."""
    active, waiting = view.active_adapters(), view.waiting_adapters()
    if adapter in active:
        return 1.0
    if len(active) + len(waiting) < view.model.max_loras:
        return 0.8
    return 0.6 if adapter in waiting else 0.0


def llmd_saturated(view: ReplicaView, queue_threshold: int = 5, kv_threshold: float = 0.8) -> bool:
    """llm-d's per-endpoint saturation test: waiting queue at the threshold or KV usage at its limit."""
    return view.queue >= queue_threshold or kv_usage(view) >= kv_threshold


class LlmdRouter(Stateless):
    """llm-d's inference scheduler (the endpoint picker of gateway-api-inference-extension) with flow control.

    Sources: llm-d/llm-d-inference-scheduler (default scorer weights of its precise-prefix guide: prefix 3,
    KV-cache utilisation 2, queue 2; max-score picker, random among equals), and
    gateway-api-inference-extension pkg/epp/saturationdetector and pkg/epp/flowcontrol. An endpoint is
    saturated when its waiting queue reaches QueueDepthThreshold (5) or its KV usage
    KVCacheUtilThreshold (0.8). The pool is saturated when no endpoint has capacity; flow control then
    holds the request at the gateway (bands by priority, first come first served here within a band)
    instead of sending it anywhere. Otherwise the scorers pick among all endpoints: the precise-prefix
    guide's profile configures scorers and a picker, no saturation filter (`saturation_filter=True`
    adds the detector's per-endpoint filter, fail-open). Scorers: prefix = matched blocks / prompt
    blocks (the precise, KV-event-fed index), KV = 1 - usage, queue = (max - q) / (max - min) over the
    candidates (1 when all equal). `approximate_blocks` swaps the precise index for the approximate
    prefix-cache scorer: an LRU per endpoint of what was routed there, of that many blocks.
    `lora_weight` adds the lora-affinity-scorer (`lora_affinity`); KServe adds it with weight 4 when a
    model declares adapters (kserve/kserve #5655).
    """

    name = "llm-d"

    def __init__(
        self,
        rng: random.Random,
        flow_control: bool = True,
        saturation_filter: bool = False,
        weights: tuple[float, float, float] = (3.0, 2.0, 2.0),
        approximate_blocks: int | None = None,
        lora_weight: float = 0.0,
    ) -> None:
        self.rng = rng
        self.lora_weight = lora_weight
        self.flow_control = flow_control
        self.saturation_filter = saturation_filter
        self.weights = weights
        self.approximate_blocks = approximate_blocks
        self.routed: dict[int, PrefixCache] = {}

    def _matched(self, view: ReplicaView, blocks: tuple[str, ...]) -> int:
        if self.approximate_blocks is None:
            return view.matched(blocks)
        routed = self.routed.get(view.index)
        return leading_cached(routed, blocks) if routed is not None else 0

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        fit = [v for v in views if not llmd_saturated(v)]
        if not fit and self.flow_control:
            return None  # the pool is saturated: held in the flow-control queue
        if not fit or not self.saturation_filter:
            fit = list(views)
        queues = [v.queue for v in fit]
        lo, hi = min(queues), max(queues)
        blocks = max(1, len(request.blocks))
        w_prefix, w_kv, w_queue = self.weights
        best, chosen = -math.inf, []
        for v in fit:
            prefix = self._matched(v, request.blocks) / blocks if w_prefix else 0.0
            kv = 1 - kv_usage(v)
            queue = 1.0 if hi == lo else (hi - v.queue) / (hi - lo)
            score = w_prefix * prefix + w_kv * max(0.0, min(1.0, kv)) + w_queue * queue
            if self.lora_weight and request.adapter >= 0:
                score += self.lora_weight * lora_affinity(v, request.adapter)
            if score > best + 1e-9:
                best, chosen = score, [v]
            elif score >= best - 1e-9:
                chosen.append(v)
        pick = self.rng.choice(chosen)
        if self.approximate_blocks is not None:
            self.routed.setdefault(pick.index, PrefixCache(self.approximate_blocks)).insert(request.blocks)
        return pick


class DynamoRouter(Stateless):
    """NVIDIA Dynamo's KV router with its router queue.

    Sources: ai-dynamo/dynamo lib/kv-router (scheduling/selector.rs, scheduling/queue.rs) and the router
    docs ("Routing Concepts", "Configuration and Tuning"). Cost per worker =
    prefill_load_scale x max(0, active prefill blocks + prompt blocks - overlap) + active decode blocks,
    argmin with router temperature 0 (random among equals); prefill_load_scale 1. The router tracks the
    prefill tokens of the requests it routed until their first token. With router_queue_threshold set, a
    request waits in the router's queue (first come first served, the default policy) while every
    worker's active prefill tokens exceed that fraction of its max_num_batched_tokens (here the chunk
    size); 4.0 is the default of the KvRouterConfig Python binding (some releases leave it unset, which
    admits every request at once: pass queue_threshold=None).
    """

    name = "dynamo"

    def __init__(
        self, rng: random.Random, prefill_load_scale: float = 1.0, queue_threshold: float | None = 4.0
    ) -> None:
        self.rng = rng
        self.scale = prefill_load_scale
        self.queue_threshold = queue_threshold

    def busy(self, view: ReplicaView) -> bool:
        if self.queue_threshold is None:
            return False
        return view.prefill_tokens() > self.queue_threshold * view.model.chunk_tokens

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        if all(self.busy(v) for v in views):
            return None  # every worker is busy: the request waits in the router's queue
        best, chosen = math.inf, []
        prompt_blocks = len(request.blocks)
        for v in views:
            new = max(0, v.prefill_blocks() + prompt_blocks - v.matched(request.blocks))
            cost = self.scale * new + v.decode_blocks()
            if cost < best - 1e-9:
                best, chosen = cost, [v]
            elif cost <= best + 1e-9:
                chosen.append(v)
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
        # As a Dynamo user would tune it for long shared prefixes: --router-prefill-load-scale raised
        # from 1 (the best of 1, 2, 4 and 8, with and without the router queue, at 60 and 90 req/s on
        # the shared-prefix workload; docs/benchmarks.md).
        "dynamo-tuned": DynamoRouter(rng, prefill_load_scale=8.0, queue_threshold=None),
        # For LoRA workloads: sluice with the adapter term off, and llm-d with the lora-affinity-scorer.
        "sluice-adapter-blind": SluiceRouter(
            PlacementPolicy(weights={**default_weights(), "adapter": 0.0}), rng
        ),
        "llm-d-lora": LlmdRouter(rng, lora_weight=4.0),
    }
    return routers[name]


ROUTERS = ("sluice", "random", "round-robin", "least-loaded", "sglang", "llm-d", "dynamo", "dynamo-tuned")
LORA_ROUTERS = ("sluice-adapter-blind", "llm-d-lora")
