"""Prefill/decode disaggregation in the fleet simulator: a fixed fleet of `gpus` replicas, some of them
prefill-only, the rest decode workers, and a split policy deciding per request.

Every policy gets the same decode-side placement (`dispatcher.table.choose_over`, what the dispatcher runs,
over exact replica state; a request it holds waits in a first-come-first-served hold, retried whenever
a request finishes) and the same prefill-worker choice
(`dispatcher.disagg.choose_prefill`); only the split decision differs:

- `never`: no prefill workers; all `gpus` replicas serve whole requests (the aggregated baseline);
- `always`: every request's prompt runs on a prefill worker;
- `threshold:T`: llm-d's rule, split when the prompt's uncached part on the chosen decode worker is at
  least T tokens;
- `auto`: sluice's decision (`dispatcher.disagg.decide_split`): both sides priced with the placement's
  latency model, from the decode worker's cached prefix, queued prefill, running requests and rates and
  the prefill worker's queue, cache and rates.

A split request runs on its prefill worker as a one-token request (the worker's own prefix cache
applies), then after the KV transfer (`fixed_s` plus `per_token_s` for each prompt token) it is placed
on its decode worker with the prompt's KV loaded: the prompt counts as cached there, and its first
token comes at the end of the decode worker's next step, as the client's stream starts from the decode
worker. Time to first token and inter-token latency are the client's.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from bench.sim.engine import Replica, Request, TimingModel
from bench.sim.metrics import ITL_SLO_S, TTFT_SLO_S, Sketch
from bench.sim.routers import heartbeat
from bench.sim.workloads import Workload, bursty_code, multi_turn, shared_prefix
from dispatcher.disagg import PrefillSide, SplitCase, choose_prefill, decide_split
from dispatcher.placement import Demand, PlacementPolicy, WorkerSnapshot
from dispatcher.table import choose_over
from queue_schemas.config import DisaggregationConfig

ARRIVAL, REPLICA, HANDOFF = 0, 1, 2
HEADER = "| policy | replicas | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | within SLO | split |"


@dataclass(frozen=True)
class Transfer:
    """Moving one prompt's KV from a prefill worker to a decode worker (see docs/benchmarks.md)."""

    fixed_s: float = 0.005
    per_token_s: float = 6.6e-6  # 320 KiB of Llama-3-70B KV per token over ~50 GB/s RDMA


@dataclass
class SplitRun:
    policy: str  # never, always, threshold:T, auto, auto:W, auto:W:M
    gpus: int = 8  # replicas in all, prefill and decode
    prefill: int = 0  # of them, prefill-only
    transfer: Transfer = field(default_factory=Transfer)


@dataclass
class SplitResult:
    run: SplitRun
    finished: int = 0
    split: int = 0
    ttft: Sketch = field(default_factory=Sketch)
    itl: Sketch = field(default_factory=Sketch)
    unfinished: int = 0
    good: int = 0  # within TTFT_SLO_S and ITL_SLO_S


def prefill_rate(model: TimingModel) -> float:
    """Prompt tokens per second of prefill compute (what a worker measures from its jobs); the latency
    model adds a step per chunk."""
    return 1 / model.prefill_per_token_s


def config_for(run: SplitRun, model: TimingModel) -> DisaggregationConfig:
    """`threshold:T` sets the threshold; `auto:W` sets `stall_weight` (auto alone: the default, 1) and
    `auto:W:M` also `min_uncached_tokens` (default 256)."""
    mode, _, arg = run.policy.partition(":")
    arg, _, least = arg.partition(":")
    extra = {"min_uncached_tokens": int(least)} if mode == "auto" and least else {}
    return DisaggregationConfig(
        **extra,
        mode=mode,  # type: ignore[arg-type]
        threshold_tokens=int(arg) if mode == "threshold" else 0,
        transfer_fixed_s=run.transfer.fixed_s,
        transfer_s_per_token=run.transfer.per_token_s,
        prefill_tokens_per_s=prefill_rate(model),
        stall_weight=float(arg) if mode == "auto" and arg else 1.0,
    )


class SplitFleet:
    def __init__(self, run: SplitRun, model: TimingModel, seed: int) -> None:
        if run.policy == "never" and run.prefill:
            raise ValueError("the aggregated baseline has no prefill workers")
        self.run = run
        self.config = config_for(run, model)
        self.decode = [Replica(i, model) for i in range(run.gpus - run.prefill)]
        self.prefill = [Replica(len(self.decode) + i, model) for i in range(run.prefill)]
        self.by_index = {r.index: r for r in self.decode + self.prefill}
        self.rng = random.Random(seed)
        # The dispatcher's placement, holds included (for a worker that can take it, for the busy worker
        # holding its prefix, for one that meets its SLO).
        self.policy = PlacementPolicy()
        self.result = SplitResult(run)
        self._heap: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._jobs: dict[int, tuple[Request, int]] = {}  # prefill job rid -> (request, decode replica)
        self._held: deque[Request] = deque()  # what the dispatcher holds, oldest first

    def _push(self, t: float, kind: int, arg: object) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, arg))

    def _post(self, replica: Replica) -> None:
        t = replica.next_event()
        if t < math.inf:
            self._push(t, REPLICA, (replica.index, replica.version))

    def run_all(self, arrivals: Iterator[Request], until: float, drain_s: float = 600.0) -> SplitResult:
        for request in arrivals:
            self._push(request.arrival, ARRIVAL, request)
        outstanding = 0
        while self._heap:
            t, _, kind, arg = heapq.heappop(self._heap)
            if t > until + drain_s:
                break
            if kind == ARRIVAL:
                assert isinstance(arg, Request)
                outstanding += 1
                if self._held or not self._arrive(arg, t):
                    self._held.append(arg)  # behind what is held already, first come first served
            elif kind == HANDOFF:
                assert isinstance(arg, tuple)
                request, index = arg
                replica = self.by_index[index]
                request.loaded = True
                replica.place(request, t)
                self._post(replica)
            else:
                assert isinstance(arg, tuple)
                index, version = arg
                replica = self.by_index[index]
                if version != replica.version:
                    continue
                for done in replica.process(t):
                    if done.rid in self._jobs:
                        request, decode = self._jobs.pop(done.rid)
                        self._push(done.done + self._transfer_s(request), HANDOFF, (request, decode))
                        continue
                    outstanding -= 1
                    self._record(done)
                while self._held and self._arrive(self._held[0], t):
                    self._held.popleft()
                for r in self.decode + self.prefill:
                    self._post(r)
        self.result.unfinished = outstanding
        return self.result

    def _transfer_s(self, request: Request) -> float:
        return self.run.transfer.fixed_s + self.run.transfer.per_token_s * request.prompt_tokens

    def _record(self, r: Request) -> None:
        self.result.finished += 1
        ttft = r.first_token - r.arrival
        itl = (r.done - r.first_token) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        self.result.ttft.add(ttft)
        if r.output_tokens > 1:
            self.result.itl.add(itl)
        self.result.good += ttft <= TTFT_SLO_S and itl <= ITL_SLO_S

    def _arrive(self, request: Request, now: float) -> bool:
        """Place the request (split or whole); False when no decode worker can take it now."""
        decode = self._choose_decode(request, now)
        if decode is None:
            return False
        side = self._choose_prefill(request, now)
        if side is not None and self._splits(request, decode, side, now):
            self.result.split += 1
            prefill = self.by_index[int(side.worker_id[1:])]
            job = replace(request, rid=-1 - request.rid, output_tokens=1)
            self._jobs[job.rid] = (request, decode.index)
            prefill.place(job, now)
            self._post(prefill)
            return True
        decode.place(request, now)
        self._post(decode)
        return True

    def _snapshot(self, replica: Replica, request: Request, now: float) -> WorkerSnapshot:
        return WorkerSnapshot(heartbeat(replica, now, 0), matched_blocks=replica.matched(request.blocks))

    def _choose_decode(self, request: Request, now: float) -> Replica | None:
        """The decode worker the dispatcher's placement picks, or None: it holds the request until a
        request finishes somewhere."""
        snapshots = [self._snapshot(r, request, now) for r in self.decode]
        waited = now - request.arrival
        demand = Demand(request.prompt_tokens, request.blocks, request.max_tokens or 256, waited_s=waited)
        decision = choose_over(snapshots, demand, now, self.policy, self.rng)
        if decision.worker_id is None:
            return None
        return self.by_index[int(decision.worker_id[1:])]

    def _choose_prefill(self, request: Request, now: float) -> PrefillSide | None:
        if not self.prefill:
            return None
        rate = prefill_rate(self.prefill[0].model)
        sides = []
        for r in self.prefill:
            hb = heartbeat(r, now, 0).model_copy(
                update={
                    "role": "prefill",
                    "prefill_tokens_per_s": rate,
                    "prefill_backlog": r.prefill_tokens(),
                }
            )
            sides.append(PrefillSide(hb, 0, r.matched(request.blocks) * r.model.block_size))
        return choose_prefill(sides, request.prompt_tokens, now, self.config, self.rng)

    def _splits(self, request: Request, decode: Replica, side: PrefillSide, now: float) -> bool:
        block = decode.model.block_size
        case = SplitCase(
            prompt_tokens=request.prompt_tokens,
            decode_cached=decode.matched(request.blocks) * block,
            decode_running=len(decode.running) + len(decode.prefilling),
            decode_rate=prefill_rate(decode.model),
            decode_waiting=len(decode.waiting),
            prefill_cached=side.matched_tokens,
            prefill_backlog=side.backlog(),
            prefill_rate=prefill_rate(decode.model),
            decode_backlog=decode.prefill_tokens(),
            decode_step_s=step_s(decode),
            prefill_step_s=step_s(self.by_index[int(side.worker_id[1:])]),
            chunk_tokens=decode.model.chunk_tokens,
        )
        return decide_split(case, self.config).split


def step_s(replica: Replica) -> float:
    """A decode step at the replica's running batch, as its worker reports it."""
    return replica.model.decode_base_s + replica.model.decode_per_seq_s * replica.scheduled


@dataclass
class Cell:
    """One configuration's figures, the median over seeds."""

    policy: str
    prefill: int
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p90: float
    slo: float  # share of requests with TTFT <= 2 s and mean ITL <= 100 ms (unfinished count as missed)
    split: float  # share of requests split
    slo_range: tuple[float, float] = (0.0, 0.0)  # over the seeds
    ttft_p90_range: tuple[float, float] = (0.0, 0.0)


def workload_at(name: str, load: float, duration_s: float) -> Workload:
    """The three workloads of the comparison at `load` times their default rates."""
    if name == "shared-prefix":
        return shared_prefix(rate=40.0 * load, duration_s=duration_s)
    if name == "multi-turn":
        return multi_turn(rate=6.0 * load, duration_s=duration_s)
    return bursty_code(rate=30.0 * load, duration_s=duration_s)


def one(run: SplitRun, workload: str, load: float, duration_s: float, seed: int) -> SplitResult:
    w = workload_at(workload, load, duration_s)
    fleet = SplitFleet(run, TimingModel(), seed)
    return fleet.run_all(w.requests(random.Random(seed)), w.duration_s)


def configurations(
    gpus: int, prefill_counts: Sequence[int], thresholds: Sequence[int], auto_settings: Sequence[str]
) -> list[SplitRun]:
    runs = [SplitRun("never", gpus, 0)]
    for p in prefill_counts:
        runs.append(SplitRun("always", gpus, p))
        runs.extend(SplitRun(f"threshold:{t}", gpus, p) for t in thresholds)
        runs.extend(SplitRun(f"auto:{a}", gpus, p) for a in auto_settings)
    return runs


def cell(run: SplitRun, results: Sequence[SplitResult]) -> Cell:
    median = statistics.median
    slos = [r.good / max(1, r.finished + r.unfinished) for r in results]
    p90s = [r.ttft.quantile(0.9) for r in results]
    return Cell(
        run.policy,
        run.prefill,
        median(r.ttft.quantile(0.5) for r in results),
        median(p90s),
        median(r.itl.quantile(0.5) for r in results),
        median(r.itl.quantile(0.9) for r in results),
        median(slos),
        median(r.split / max(1, r.finished + r.unfinished) for r in results),
        (min(slos), max(slos)),
        (min(p90s), max(p90s)),
    )


def best(cells: Sequence[Cell], family: str) -> Cell:
    """The family's configuration its users would pick: the most requests within the SLO, then the lowest
    p90 TTFT (each policy tuned over its prefill/decode ratio, the threshold rule also over T, sluice's
    also over its stall weight)."""
    mine = [c for c in cells if c.policy.split(":")[0] == family]
    return max(mine, key=lambda c: (round(c.slo, 4), -c.ttft_p90))


def spread(lo: str, hi: str) -> str:
    """The seeds' range as shown, or nothing when it rounds to one value."""
    return f" [{lo}-{hi}]" if lo != hi else ""


def row(c: Cell, gpus: int) -> str:
    ratio = f"{c.prefill}P:{gpus - c.prefill}D" if c.prefill else f"{gpus} whole"
    lo, hi = c.ttft_p90_range
    p90 = f"{c.ttft_p90 * 1000:,.0f}" + spread(f"{lo * 1000:,.0f}", f"{hi * 1000:,.0f}")
    slo = f"{c.slo:.1%}" + spread(f"{c.slo_range[0]:.1%}", f"{c.slo_range[1]:.1%}")
    return (
        f"| {c.policy} | {ratio} | {c.ttft_p50 * 1000:,.0f} | {p90} "
        f"| {c.itl_p50 * 1000:.1f} | {c.itl_p90 * 1000:.1f} | {slo} | {c.split:.0%} |"
    )


WORKLOADS = ("shared-prefix", "multi-turn", "bursty-code")
THRESHOLDS = (256, 1024, 4096)  # llm-d's threshold T, in prompt tokens uncached on the decode worker
AUTO_SETTINGS = ("1", "4")  # sluice's W, or W:M (stall weight, least uncached tokens to split)


def main(
    seeds: Sequence[int],
    jobs: int,
    duration_s: float,
    loads: Sequence[float],
    show_all: bool = False,
    workloads: Sequence[str] = WORKLOADS,
    thresholds: Sequence[int] = THRESHOLDS,
    auto_settings: Sequence[str] = AUTO_SETTINGS,
) -> None:
    gpus, prefill_counts = 8, (1, 2, 3, 4, 6)
    for load in loads:
        for name in workloads:
            w = workload_at(name, load, duration_s)
            runs = configurations(gpus, prefill_counts, thresholds, auto_settings)
            tasks = [(run, name, load, duration_s, seed) for run in runs for seed in seeds]
            with ProcessPoolExecutor(jobs) as pool:
                results = list(pool.map(_one, tasks))
            cells = [cell(run, results[i * len(seeds) : (i + 1) * len(seeds)]) for i, run in enumerate(runs)]
            print(f"\n**{w.name}, load x{load:g}: {w.description}; {gpus} replicas, {duration_s:.0f} s**\n")
            print(HEADER)
            print("| --- " * 8 + "|")
            for c in [best(cells, f) for f in ("never", "always", "threshold", "auto")]:
                print(row(c, gpus))
            if show_all:
                print("\nEvery configuration:\n")
                print(HEADER)
                print("| --- " * 8 + "|")
                for c in cells:
                    print(row(c, gpus))


def _one(task: tuple[SplitRun, str, float, float, int]) -> SplitResult:
    return one(*task)
