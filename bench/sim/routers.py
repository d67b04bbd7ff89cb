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
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bench.sim.engine import Request, leading_cached
from bench.sim.views import ReplicaView
from dispatcher.placement import Demand, PlacementPolicy
from dispatcher.scorers import default_weights
from dispatcher.table import WorkerTable, choose_fast, refused_by_all
from gpu_workers.prefix_cache import PrefixCache
from plumbing.latency import Correction
from queue_schemas.messages import Heartbeat, Priority, WorkerState


class Router(Protocol):
    name: str

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None: ...

    def observe(self, views: Sequence[ReplicaView], now: float) -> None:
        """A report from every replica (at each heartbeat; before every decision with exact views)."""
        ...


def heartbeat(view: ReplicaView, now: float, seq: int, correction: float = 1.0) -> Heartbeat:
    """What the replica's worker would report. Its prefill rate and decode step are the ones it would
    measure: prompt tokens per second of prefill compute, and a step without prefill at its running
    batch; its prefill backlog is the uncached prompt tokens routed to it without a first token."""
    m = view.model
    return Heartbeat.model_construct(
        worker_id=f"r{view.index}", pool="sim", model="llama-70b", state=WorkerState.READY, seq=seq,
        sent_at=now, ttl_ms=3000, kv_blocks_total=m.kv_blocks, kv_blocks_free=max(0, view.free_blocks),
        block_size=m.block_size, running=view.scheduled, waiting=view.queue, inbox_pending=0,
        max_running=m.max_seqs, decode_tokens_per_s=0.0, started_at=0.0, ready_at=0.0,
        completed_per_s=view.completed_per_s, prefill_backlog=view.prefill_tokens(),
        prefill_tokens_per_s=1 / m.prefill_per_token_s,
        step_s=m.decode_base_s + m.decode_per_seq_s * view.scheduled, ttft_correction=correction,
        adapter_slots=m.max_loras, adapters_in_use=len(view.active_adapters()) if m.max_loras else 0,
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
    table filled from the views' reports (heartbeats, every 0.5 s), with the dispatcher's own placements
    since added in, and the prefix match of its KV-event index."""

    name = "sluice"
    fair_hold = True  # the fleet's hold runs the dispatcher's order (dispatcher.hold.FairQueue)

    def __init__(self, policy: PlacementPolicy, rng: random.Random) -> None:
        self.policy = policy
        self.rng = rng
        self.table = WorkerTable(latency=policy.latency)
        self._seq = 0
        self.decision_s = 0.0
        self.decisions = 0
        # (time, table changes) at which every row was last found stale or full: until either moves, every
        # request is held without being scored (a long hold is retried many times between two changes).
        self._changes = 0
        self._refused_at: tuple[float, int] | None = None
        # The latency model's correction per replica, from each placement's prediction (uncorrected,
        # corrected, when) and its observed first token; and the corrected prediction's relative errors.
        self.corrections: dict[int, Correction] = {}
        self._predicted: dict[int, tuple[int, float, float, float]] = {}
        self.errors: list[float] = []

    def _forget_gone(self, live: Collection[str]) -> None:
        for worker_id in [w for w in self.table.ids if w not in live]:
            self.table.remove(worker_id)
            self._changes += 1

    def observe(self, views: Sequence[ReplicaView], now: float) -> None:
        self._forget_gone({f"r{v.index}" for v in views})
        for v in views:
            self._seq += 1
            correction = self.corrections.get(v.index)
            factor = 1.0 if correction is None else correction.factor
            self.table.upsert(heartbeat(v, now, self._seq, factor), 0, 0)
        self._changes += 1

    def first_token(self, request: Request, now: float) -> None:
        """The worker's side of the correction: the observed first-token time against the prediction."""
        placed = self._predicted.pop(request.rid, None)
        if placed is None or math.isnan(placed[1]):
            return
        index, raw, corrected, at = placed
        observed = request.first_token - at
        self.corrections.setdefault(index, Correction()).observe(raw, observed)
        if observed > 0:
            self.errors.append(abs(observed - corrected) / observed)

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if self._refused_at == (now, self._changes):
            return None  # (a worker gone since cannot make room)
        by_id = {f"r{v.index}": v for v in views}
        self._forget_gone(by_id)
        if not len(self.table):
            return None
        matched = np.array([by_id[w].indexed(request.blocks) for w in self.table.ids], dtype=float)
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
            if refused_by_all(self.table, now, self.policy):  # it would hold any request until a change
                self._refused_at = (now, self._changes)
            return None
        self.table.add_in_flight(decision.worker_id, decision.blocks_needed, decision.uncached_tokens, now)
        self._changes += 1
        chosen = by_id[decision.worker_id]
        correction = self.corrections.get(chosen.index)
        factor = 1.0 if correction is None else correction.factor
        raw = decision.predicted_ttft_s
        self._predicted[request.rid] = (chosen.index, raw, raw * factor, now)
        return chosen


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


class InFlight:
    """What a gateway counts itself: the requests it routed to each replica that have not ended."""

    def __init__(self) -> None:
        self.count: Counter[int] = Counter()

    def routed(self, view: ReplicaView) -> None:
        self.count[view.index] += 1

    def finished(self, request: Request, now: float) -> None:
        if self.count[request.replica] > 0:
            self.count[request.replica] -= 1


class SglangRouter(Stateless):
    """SGLang's model gateway (sgl-router), policy `cache_aware`.

    Sources: sgl-project/sglang `sgl-router/src/policies/cache_aware.rs` and the launcher's defaults in
    `sgl-router/py_src/sglang_router/router_args.py` (cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5; 0.5 / 32 / 1.1 is only the Rust `impl Default`). Load is the requests the
    router has in flight per worker, counted exactly by the router itself (up when it routes, down when
    the response ends). If the load is imbalanced (max - min > balance_abs_threshold and
    max > balance_rel_threshold x min) it takes the least loaded worker. Otherwise it takes the worker
    whose radix tree matches the longest share of the request's text if that share exceeds
    cache_threshold, and else the least loaded worker (the smallest-tree fallback was replaced by
    least-load in sgl-project/sglang PR #14650, merged 2025-12-08). Either way the request's text goes
    into the chosen worker's tree: the trees are the router's routing history alone (here in blocks, not
    characters), never the engines' caches; `max_tree_size` (2^26 characters by default, swept every
    `eviction_interval_secs`) bounds them far above these workloads, so nothing is evicted here.
    """

    name = "sglang"

    def __init__(
        self, rng: random.Random, threshold: float = 0.3, abs_thr: int = 64, rel_thr: float = 1.5
    ) -> None:
        self.rng = rng
        self.threshold, self.abs_thr, self.rel_thr = threshold, abs_thr, rel_thr
        self.load = InFlight()
        self.trees: dict[int, PrefixCache] = {}

    def finished(self, request: Request, now: float) -> None:
        self.load.finished(request, now)

    def _least_loaded(self, views: Sequence[ReplicaView]) -> ReplicaView:
        low = min(self.load.count[v.index] for v in views)
        return self.rng.choice([v for v in views if self.load.count[v.index] == low])

    def _tree(self, index: int) -> PrefixCache:
        tree = self.trees.get(index)
        if tree is None:
            tree = self.trees[index] = PrefixCache(1 << 30)
        return tree

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        loads = [self.load.count[v.index] for v in views]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_thr and hi > self.rel_thr * lo:
            pick = self._least_loaded(views)
        else:
            blocks = max(1, len(request.blocks))
            ratios = [leading_cached(self._tree(v.index), request.blocks) / blocks for v in views]
            best = max(ratios)
            if best > self.threshold:
                pick = self.rng.choice([v for v, m in zip(views, ratios, strict=True) if m == best])
            else:
                pick = self._least_loaded(views)
        self._tree(pick.index).insert(request.blocks)
        self.load.routed(pick)
        return pick


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
    """llm-d's inference scheduler (the endpoint picker of gateway-api-inference-extension), as deployed.

    Sources: llm-d/llm-d `guides/precise-prefix-cache-aware/gaie-kv-events/values.yaml` (scorer weights
    prefix 3, KV-cache utilisation 2, queue 2; the newer sample `deploy/config/
    epp-precise-prefix-cache-config.yaml` uses 2 / 1 / 1: `weights=(2, 1, 1)`), the scorers of
    llm-d/llm-d-inference-scheduler (`preciseprefixcache`, `kvcacheutilization`, `queuedepth`; max-score
    picker, random among equals), and gateway-api-inference-extension `pkg/epp/saturationdetector`
    (an endpoint is saturated at waiting queue >= 5 or KV usage >= 0.8) and `pkg/epp/flowcontrol`.
    Scorers: prefix = matched blocks / prompt blocks (the precise index, fed by KV events), KV =
    1 - usage, queue = (max - q) / (max - min) over the candidates (1 when all equal). The endpoint
    metrics are scraped every 50 ms (`refresh_s`; `--refresh-metrics-interval`, `pkg/epp/server/
    options.go`).

    Flow control is behind the experimental `flowControl` feature gate (`cmd/epp/runner/runner.go`), so
    by default (`flow_control=False`) the picker never holds: with every endpoint saturated it rejects
    only sheddable requests (priority < 0, none in these workloads) and schedules the rest as usual.
    With the gate on (`flow_control=True`, the `llm-d-flow-control` row), a request arriving while no
    endpoint has capacity waits at the gateway (first come first served here within a priority band).
    `saturation_filter=True` adds the detector's per-endpoint filter (fail-open). `approximate_blocks`
    swaps the precise index for the approximate prefix-cache scorer: an LRU per endpoint of what was
    routed there, of that many blocks. `lora_weight` adds the lora-affinity-scorer (`lora_affinity`;
    gateway-api-inference-extension v1.5.0
    `pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go`); KServe adds it with
    weight 4 when a model declares adapters (kserve/kserve #5655). Its adapter lists are the scraped
    ones plus its own placements since.
    """

    name = "llm-d"
    refresh_s = 0.05

    def __init__(
        self,
        rng: random.Random,
        flow_control: bool = False,
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
            return view.indexed(blocks)
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


@dataclass
class _Routed:
    """What the predicted-latency picker saw when it routed a request (its training example)."""

    at: float
    ttft_features: np.ndarray
    tpot_features: np.ndarray


class OnlineLatencyModel:
    """An online least-squares regressor in place of llm-d's XGBoost: refitted every `refit_s` on the
    last `window` completions once it has `min_samples` (llm-d's helm values: retrain every 1-10 s, at
    least 100 samples, the mean objective). It is linear in its features, so unlike boosted trees it
    cannot learn thresholds (a queue that starts to grow at a given KV use) or interactions it is not
    given; the TTFT model is given the product of the waiting queue and the uncached prompt for that."""

    def __init__(self, width: int, window: int = 5000, min_samples: int = 100, refit_s: float = 1.0):
        self.x: deque[np.ndarray] = deque(maxlen=window)
        self.y: deque[float] = deque(maxlen=window)
        self.coef = np.zeros(width)
        self.min_samples, self.refit_s = min_samples, refit_s
        self.fitted_at = -math.inf
        self.trained = False

    def learn(self, features: np.ndarray, observed: float, now: float) -> None:
        self.x.append(features)
        self.y.append(observed)
        if len(self.y) >= self.min_samples and now - self.fitted_at >= self.refit_s:
            self.coef = np.linalg.lstsq(np.array(self.x), np.array(self.y), rcond=None)[0]
            self.fitted_at, self.trained = now, True

    def predict(self, features: np.ndarray) -> np.ndarray:
        return features @ self.coef


class LlmdPredictedLatencyRouter(Stateless):
    """llm-d's predicted-latency scheduling: per-pod TTFT and TPOT predicted from the pod's metrics and the
    request, against the request's SLO headers.

    Sources: llm-d/llm-d-inference-scheduler (HEAD of 2026-05: `slo-headroom-tier-filter`,
    `latency-scorer`, `latency-slo-admitter`) and gateway-api-inference-extension v1.3.0
    (`slo_aware_router`, `latencypredictor/training_server.py`). Features: TTFT from KV use, input tokens,
    waiting and running requests, prefix-cache score and effective (uncached) input tokens; TPOT from KV
    use, input tokens, waiting and running. Every request carries the SLOs the tables score
    (`x-slo-ttft-ms` 2,000 and `x-slo-tpot-ms` 100). A pod is valid when both predictions are under them.
    The affinity gate keeps only pods with a prefix score of at least 0.99 if there are any, and then within
    the chosen tier at least 0.80, except with probability 0.01 (epsilon-greedy exploration). The positive
    tier (valid pods) is used unless, with probability 0.01, the negative one is explored; within it, the
    pick is weighted random favouring the least headroom (TTFT and TPOT headroom min-max normalised and
    blended 0.8 / 0.2, weight (1 - blend) x 99 + 2). With no valid pod, an idle one (no running requests)
    is preferred; else the pods violating TPOT only, then TTFT only, then both, weighted by how far they
    miss ((1 - badness) x 80 + 2). Only sheddable requests (none here) are refused. The model is
    `OnlineLatencyModel`, trained on this run's own requests (TTFT at each first token, TPOT at each
    end); until it has its first fit every prediction is 0. The TPOT SLO of 100 ms is often out of reach
    on a replica running a 2,048-token prefill chunk (about 180 ms a step), so much of the time no pod
    is valid and it picks from the negative tier.
    """

    name = "llm-d-predicted"
    refresh_s = 0.05
    TTFT_SLO_S = 2.0
    TPOT_SLO_S = 0.1

    def __init__(self, rng: random.Random, explore: float = 0.01, tau: float = 0.80) -> None:
        self.rng = rng
        self.explore, self.tau = explore, tau
        self.ttft = OnlineLatencyModel(8)
        self.tpot = OnlineLatencyModel(5)
        self.routed: dict[int, _Routed] = {}

    @staticmethod
    def _features(request: Request, view: ReplicaView) -> tuple[np.ndarray, np.ndarray, float]:
        blocks = max(1, len(request.blocks))
        prefix = view.indexed(request.blocks) / blocks
        tokens = float(request.prompt_tokens)
        effective = (1 - prefix) * tokens
        kv, waiting, running = kv_usage(view), float(view.queue), float(view.scheduled)
        ttft = np.array([1.0, kv, tokens, waiting, running, prefix, effective, waiting * effective / 1000])
        tpot = np.array([1.0, kv, tokens, waiting, running])
        return ttft, tpot, prefix

    def first_token(self, request: Request, now: float) -> None:
        """A TTFT sample, as the gateway records it at the stream's first chunk."""
        seen = self.routed.get(request.rid)
        if seen is not None:
            self.ttft.learn(seen.ttft_features, request.first_token - seen.at, now)

    def finished(self, request: Request, now: float) -> None:
        seen = self.routed.pop(request.rid, None)
        if seen is None:
            return
        if request.output_tokens > 1:
            tpot = (request.done - request.first_token) / (request.output_tokens - 1)
            self.tpot.learn(seen.tpot_features, tpot, now)

    def _gate(self, pods: list[int], prefix: np.ndarray, tau: float) -> list[int]:
        if self.rng.random() < self.explore:
            return pods
        sticky = [i for i in pods if prefix[i] >= tau]
        return sticky or pods

    def _weighted(self, pods: list[int], badness: np.ndarray, top: float) -> int:
        weights = [(1 - badness[i]) * top + 2 for i in pods]
        return self.rng.choices(pods, weights=weights)[0]

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        rows = [self._features(request, v) for v in views]
        ttft_x = np.array([r[0] for r in rows])
        tpot_x = np.array([r[1] for r in rows])
        prefix = np.array([r[2] for r in rows])
        ttft_room = self.TTFT_SLO_S - self.ttft.predict(ttft_x)
        tpot_room = self.TPOT_SLO_S - self.tpot.predict(tpot_x)
        everyone = self._gate(list(range(len(views))), prefix, 0.99)
        valid = [i for i in everyone if ttft_room[i] > 0 and tpot_room[i] > 0]
        invalid = [i for i in everyone if i not in valid]
        use_valid = bool(valid) and not (invalid and self.rng.random() < self.explore)
        if use_valid:
            tier = self._gate(valid, prefix, self.tau)
            blend = 0.8 * _normalised(ttft_room, tier) + 0.2 * _normalised(tpot_room, tier)
            pick = self._weighted(tier, blend, 99)
        else:
            tier = self._gate(invalid, prefix, self.tau)
            idle = [i for i in tier if views[i].scheduled == 0]
            if idle:
                pick = self.rng.choice(idle)
            else:
                tpot_only = [i for i in tier if ttft_room[i] > 0]
                ttft_only = [i for i in tier if tpot_room[i] > 0]
                both = [i for i in tier if ttft_room[i] <= 0 and tpot_room[i] <= 0]
                group = tpot_only or ttft_only or both
                deficit = 0.8 * _normalised(-ttft_room, group) + 0.2 * _normalised(-tpot_room, group)
                pick = self._weighted(group, deficit, 80)
        self.routed[request.rid] = _Routed(now, ttft_x[pick], tpot_x[pick])
        return views[pick]


def _normalised(values: np.ndarray, among: list[int]) -> np.ndarray:
    """`values` min-max scaled to [0, 1] over the indexes `among` (0 where they are all equal)."""
    chosen = values[among]
    lo, hi = float(chosen.min()), float(chosen.max())
    if hi - lo < 1e-12:
        return np.zeros_like(values)
    return np.clip((values - lo) / (hi - lo), 0.0, 1.0)


class DynamoRouter(Stateless):
    """NVIDIA Dynamo's KV router, with the defaults of its frontend (ai-dynamo 1.6.1).

    Sources: ai-dynamo/dynamo `lib/kv-router/src/scheduling/config.rs` and `selector`, `lib/llm/src/
    kv_router/sequence.rs` (the active-sequence accounting) and `scheduling/queue.rs`; defaults from the
    `ai-dynamo` 1.6.1 frontend: prefill load scale (the overlap score weight) 1.0, temperature 0,
    `router_track_output_blocks = false`, `router_assume_kv_reuse = true`, no router queue
    (`router_queue_threshold` None; 1.2.1 set 4.0, some Rust defaults 16.0: `queue_threshold`).

    Cost per worker = scale x potential prefill blocks + potential decode blocks, the lowest taken (ties at
    random). Potential prefill tokens = the prefill tokens of the worker's active requests + this prompt's
    tokens not matched by the KV-event index there; each active request's prefill is fixed when it is
    routed (its prompt less its overlap then) and dropped whole at its first token. Potential decode blocks
    = the worker's active prompt blocks, each counted once however many requests share it (blocks are
    keyed by their chained hashes), plus this prompt's blocks not among them: a worker already serving a
    tenant's requests pays nothing more for that tenant's shared prefix. No output blocks are counted.
    All of it is the router's own exact bookkeeping of what it routed, freed when a response ends. With
    `queue_threshold` set, a request waits in the router's queue (first come first served) while every
    worker's active prefill tokens exceed that multiple of its max_num_batched_tokens (the chunk size).
    """

    name = "dynamo"

    def __init__(
        self, rng: random.Random, prefill_load_scale: float = 1.0, queue_threshold: float | None = None
    ) -> None:
        self.rng = rng
        self.scale = prefill_load_scale
        self.queue_threshold = queue_threshold
        self.active: dict[int, Counter[str]] = {}  # worker -> its active prompt blocks, with holders
        self.prefill: dict[int, dict[int, tuple[Request, int]]] = {}  # worker -> rid -> (request, tokens)

    def finished(self, request: Request, now: float) -> None:
        blocks = self.active.get(request.replica)
        if blocks is not None:
            blocks.subtract(request.blocks)
            for h in request.blocks:
                if blocks[h] <= 0:
                    del blocks[h]
        self.prefill.get(request.replica, {}).pop(request.rid, None)

    def prefill_tokens(self, index: int, now: float) -> int:
        """The worker's active prefill tokens: requests routed there with no first token yet."""
        pending = self.prefill.get(index, {})
        for rid in [rid for rid, (r, _) in pending.items() if r.first_token <= now]:
            del pending[rid]
        return sum(tokens for _, tokens in pending.values())

    def new_blocks(self, index: int, blocks: tuple[str, ...]) -> int:
        """The prompt's blocks not among the worker's active ones (active prompts are held whole, so
        the active ones are a leading run)."""
        return len(blocks) - leading_cached(self.active.get(index, Counter()), blocks)

    def busy(self, view: ReplicaView, now: float) -> bool:
        if self.queue_threshold is None:
            return False
        return self.prefill_tokens(view.index, now) > self.queue_threshold * view.model.chunk_tokens

    def route(self, request: Request, views: Sequence[ReplicaView], now: float) -> ReplicaView | None:
        if not views:
            return None
        if all(self.busy(v, now) for v in views):
            return None  # every worker is busy: the request waits in the router's queue
        best, chosen = math.inf, []
        bs = views[0].model.block_size
        for v in views:
            uncached = max(0, request.prompt_tokens - v.indexed(request.blocks) * bs)
            prefill = (self.prefill_tokens(v.index, now) + uncached) / bs
            decode = len(self.active.get(v.index, ())) + self.new_blocks(v.index, request.blocks)
            cost = self.scale * prefill + decode
            if cost < best - 1e-9:
                best, chosen = cost, [(v, uncached)]
            elif cost <= best + 1e-9:
                chosen.append((v, uncached))
        pick, uncached = self.rng.choice(chosen)
        self.active.setdefault(pick.index, Counter()).update(request.blocks)
        self.prefill.setdefault(pick.index, {})[request.rid] = (request, uncached)
        return pick


# Each tuned router's main knob, as `python -m bench.sim.tuning` chose it: the same sweep for each (four
# settings at 60 and 90 req/s on the shared-prefix workload, 300 s, seed 1, views per design), the lowest
# p90 TTFT summed over the two rates. docs/benchmarks.md prints the sweep.
TUNED: dict[str, float] = {
    "sluice": 5.0,  # the prefix scorer's weight (kv 2, queue 2, adapter 3)
    "llm-d": 3.0,  # the prefix scorer's weight (kv 2, queue 2)
    "sglang": 128.0,  # balance_abs_threshold
    "dynamo": 2.0,  # --router-prefill-load-scale
    "llm-d-predicted": 0.90,  # the affinity gate's threshold
}


def knob_router(family: str, value: float, rng: random.Random) -> Router:
    """The router of `family` with its main knob at `value` (the sweep of `bench.sim.tuning`)."""
    if family == "sluice":
        return SluiceRouter(PlacementPolicy(weights={**default_weights(), "prefix": value}), rng)
    if family == "llm-d":
        return LlmdRouter(rng, weights=(value, 2.0, 2.0))
    if family == "sglang":
        return SglangRouter(rng, abs_thr=int(value))
    if family == "dynamo":
        return DynamoRouter(rng, prefill_load_scale=value)
    if family == "llm-d-predicted":
        return LlmdPredictedLatencyRouter(rng, tau=value)
    raise ValueError(family)


def make_router(name: str, seed: int, policy: PlacementPolicy | None = None) -> Router:
    rng = random.Random(seed)
    if name.endswith("-tuned"):
        family = name.removesuffix("-tuned")
        return knob_router(family, TUNED[family], rng)
    routers: dict[str, Router] = {
        "sluice": SluiceRouter(policy or PlacementPolicy(), rng),
        # The weighted sum of unitless scores that was the default before the latency model.
        "sluice-scores": SluiceRouter(PlacementPolicy(objective="score"), rng),
        "random": RandomRouter(rng),
        "round-robin": RoundRobinRouter(),
        "least-loaded": LeastLoadedRouter(rng),
        "sglang": SglangRouter(rng),
        "llm-d": LlmdRouter(rng),
        "llm-d-flow-control": LlmdRouter(rng, flow_control=True),
        "llm-d-predicted": LlmdPredictedLatencyRouter(rng),
        "dynamo": DynamoRouter(rng),
        # For LoRA workloads: sluice's weighted sum with the adapter term off, and llm-d with the
        # lora-affinity-scorer.
        "sluice-adapter-blind": SluiceRouter(
            PlacementPolicy(weights={**default_weights(), "adapter": 0.0}, objective="score"), rng
        ),
        "llm-d-lora": LlmdRouter(rng, lora_weight=4.0),
    }
    return routers[name]


TUNABLE = tuple(TUNED)
# The tables' routers. A family whose sweep kept its default has no -tuned row (it would repeat the
# default's); `--routers NAME-tuned` runs any of them.
ROUTERS = (
    "sluice", "sluice-scores", "random", "round-robin", "least-loaded", "sglang", "sglang-tuned", "llm-d",
    "llm-d-flow-control", "llm-d-predicted", "llm-d-predicted-tuned", "dynamo", "dynamo-tuned",
)  # fmt: skip
LORA_ROUTERS = ("sluice-adapter-blind", "llm-d-lora")
