"""`python -m bench.sim EXPERIMENT`: run the fleet simulator and print its tables (and draw its plots).

- placement: every router on the shared-prefix workload at several rates (8 replicas), over seeds, with
  exact views and with heartbeat views;
- workloads: every router on multi-turn chat, bursty code completion and a batch flood, over seeds;
- priority: the batch flood on engines that schedule first come first served and by priority;
- scaling: the scaling rules on a diurnal day, 3-minute start-up, over seeds, each rule's knob swept (its
  violation-minutes against GPU-hours are the frontier plot);
- frontier: the frontier plot from the tables of `scaling` runs made separately (`--tables`);
- llmd: llm-d's precise-prefix-cache benchmark as llm-d describes it (llmd_experiment.py);
- scale: 64 replicas and one hour of shared-prefix traffic, timed;
- lora: 50 LoRA adapters of Zipf popularity over 8 replicas holding 8 each: sluice's adapter-affinity
  placement against the same placement blind to adapters and the baselines;
- disagg: prefill/decode disaggregation on 8 replicas (disagg.py): sluice's per-request split decision
  against never, always and llm-d's threshold rule, each at its best prefill/decode ratio;
- error: the latency model's error, its corrected prediction against the first token observed, for
  sluice's placement on the placement workloads.

Each cell of a table over seeds is the median over the seeds with the [min-max] range beside it.
Runs go over `--jobs` processes; each run is seeded, so the tables do not depend on the number of jobs.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.sim.disagg import AUTO_SETTINGS as DISAGG_AUTO
from bench.sim.disagg import THRESHOLDS as DISAGG_THRESHOLDS
from bench.sim.disagg import WORKLOADS as DISAGG_WORKLOADS
from bench.sim.engine import TimingModel
from bench.sim.fleet import Outcome, Scaler, simulate
from bench.sim.metrics import Summary, summarize, violation_minutes
from bench.sim.routers import LORA_ROUTERS, ROUTERS, TUNABLE, Router, SluiceRouter, make_router
from bench.sim.scalers import (
    DynamoAggPlannerScaler,
    DynamoPlannerScaler,
    KedaScaler,
    LlmdWvaScaler,
    ReactiveScaler,
    SluiceScaler,
)
from bench.sim.views import Mode
from bench.sim.workloads import (
    FLOOD_AT_S,
    Workload,
    batch_flood,
    bursty_code,
    diurnal,
    lora_zipf,
    multi_turn,
    shared_prefix,
)
from dispatcher.placement import PlacementPolicy
from scaler.policy import ScalingPolicy

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "bursty-code": bursty_code,
    "batch-flood": batch_flood,
    "lora-zipf": lora_zipf,
}


@dataclass(frozen=True)
class Run:
    """One simulated run, described by names and numbers so that it can go to another process."""

    workload: str
    kwargs: tuple[tuple[str, Any], ...]
    router: str
    seed: int
    views: Mode
    replicas: int = 8
    heartbeat_s: float = 0.5
    scheduling: str = "fcfs"  # the replicas' engine scheduling: fcfs or priority
    max_loras: int = 0  # adapters a replica holds (0: no LoRA)


@dataclass
class Result:
    summary: Summary
    unfinished: int
    batch: Summary | None = None
    extra: dict[str, float] = field(default_factory=dict)


def run_one(run: Run) -> Result:
    w = WORKLOADS[run.workload](**dict(run.kwargs))
    flood = run.workload == "batch-flood"
    out = simulate(
        functools.partial(make_router, run.router, run.seed),
        TimingModel(scheduling=run.scheduling, max_loras=run.max_loras),
        w.requests, w.duration_s, run.replicas, seed=run.seed, heartbeat_s=run.heartbeat_s, views=run.views,
        split_at=FLOOD_AT_S if flood else None,
    )  # fmt: skip
    batch = summarize(out, "batch") if flood else None
    extra = {"preemptions": float(out.stats.preemptions), "adapter_loads": float(out.stats.adapter_loads)}
    if flood:
        extra |= {"alone_p99": out.stats.before.quantile(0.99), "beside_p99": out.stats.after.quantile(0.99)}
        extra |= {"alone_p50": out.stats.before.quantile(0.5), "beside_p50": out.stats.after.quantile(0.5)}
    return Result(summarize(out), out.unfinished, batch, extra)


def spread(values: Sequence[float], fmt: str | Callable[[float], str]) -> str:
    """Median [min-max] of a figure over seeds (the range only where the seeds differ, as printed)."""
    f = fmt if callable(fmt) else (lambda v: format(v, fmt))
    mid, lo, hi = (f(v) for v in (statistics.median(values), min(values), max(values)))
    return mid if lo == hi else f"{mid} [{lo}-{hi}]"


def ttft_ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}" if seconds >= 1 else f"{seconds * 1000:.1f}"


PLACEMENT_HEADER = (
    "| router | p50 TTFT ms | p90 TTFT ms | p99 TTFT s | p90 ITL ms | tokens/s | prefix hits | SLO met "
    "| unfinished |"
)


def placement_row(name: str, results: list[Result]) -> str:
    s = [r.summary for r in results]
    return (
        f"| {name} | {spread([x.ttft_p50 for x in s], ttft_ms)} | {spread([x.ttft_p90 for x in s], ttft_ms)} "
        f"| {spread([x.ttft_p99 for x in s], '.2f')} | {spread([x.itl_p90 * 1000 for x in s], '.0f')} "
        f"| {spread([x.tokens_per_s for x in s], ',.0f')} | {spread([x.hit_rate * 100 for x in s], '.0f')}% "
        f"| {spread([x.slo_attainment * 100 for x in s], '.1f')}% "
        f"| {spread([float(r.unfinished) for r in results], '.0f')} |"
    )


def run_table(
    title: str,
    runs: dict[str, list[Run]],
    pool: ProcessPoolExecutor,
    header: str = PLACEMENT_HEADER,
    row: Callable[[str, list[Result]], str] = placement_row,
) -> dict[str, list[Result]]:
    """Run every row's seeds in the pool and print the table (`header`, one `row` per name) as results
    come in."""
    futures = {name: [pool.submit(run_one, r) for r in rs] for name, rs in runs.items()}
    print(f"\n**{title}**\n")
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    results = {}
    for name, fs in futures.items():
        results[name] = [f.result() for f in fs]
        print(row(name, results[name]), flush=True)
    return results


def placement(args: argparse.Namespace) -> None:
    print(f"seeds {args.seeds}; views {args.views}; heartbeat {args.heartbeat_s:g} s")
    by_rate: dict[str, dict[float, dict[str, list[Result]]]] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for views in args.views:
            for rate in args.rates:
                kwargs = (("rate", rate), ("duration_s", args.duration))
                w = shared_prefix(rate=rate, duration_s=args.duration)
                runs = {
                    name: [Run("shared-prefix", kwargs, name, seed, views, 8, args.heartbeat_s)
                           for seed in args.seeds]
                    for name in args.routers
                }  # fmt: skip
                title = f"{w.description}; 8 replicas, {w.duration_s:.0f} s; {views} views"
                by_rate.setdefault(views, {})[rate] = run_table(title, runs, pool)
    if args.plots:
        plot_placement(by_rate, args.plots / f"sim_placement_{'_'.join(args.views)}.png")


def workloads(args: argparse.Namespace) -> None:
    print(f"seeds {args.seeds}; views {args.views}; heartbeat {args.heartbeat_s:g} s")
    with ProcessPoolExecutor(args.jobs) as pool:
        for views in args.views:
            for name, kwargs in (
                ("multi-turn", (("duration_s", args.duration),)),
                ("bursty-code", (("duration_s", args.duration),)),
                ("batch-flood", ()),
            ):
                w = WORKLOADS[name](**dict(kwargs))
                runs = {
                    router: [Run(name, kwargs, router, s, views, 8, args.heartbeat_s) for s in args.seeds]
                    for router in args.routers
                }
                title = f"{w.name}: {w.description}; 8 replicas, {w.duration_s:.0f} s; {views} views"
                results = run_table(title, runs, pool)
                if name == "batch-flood":
                    print("\nbatch requests finished by the end of the run (of 20,000), their p50 TTFT s:")
                    for router, rs in results.items():
                        done = [float(r.batch.finished) if r.batch else 0.0 for r in rs]
                        p50 = [r.batch.ttft_p50 if r.batch else float("nan") for r in rs]
                        print(f"- {router}: {spread(done, ',.0f')} done, p50 TTFT {spread(p50, ',.0f')} s")


PRIORITY_HEADER = (
    "| router | engine | interactive p50 alone / beside ms | p99 alone / beside s | p99 ratio | SLO met "
    "| batch done by 600 s | batch p50 TTFT s | tokens/s | preemptions |"
)


def priority_row(name: str, scheduling: str, results: list[Result]) -> str:
    x = [r.extra for r in results]
    ratio = [e["beside_p99"] / e["alone_p99"] for e in x]
    batch = [r.batch for r in results]
    return (
        f"| {name} | {scheduling} | {spread([e['alone_p50'] for e in x], ttft_ms)} / "
        f"{spread([e['beside_p50'] for e in x], ttft_ms)} | {spread([e['alone_p99'] for e in x], '.2f')} / "
        f"{spread([e['beside_p99'] for e in x], '.2f')} | {spread(ratio, '.2f')} "
        f"| {spread([r.summary.slo_attainment * 100 for r in results], '.1f')}% "
        f"| {spread([float(b.finished) if b else 0.0 for b in batch], ',.0f')} "
        f"| {spread([b.ttft_p50 if b else math.nan for b in batch], ',.0f')} "
        f"| {spread([r.summary.tokens_per_s for r in results], ',.0f')} "
        f"| {spread([e['preemptions'] for e in x], ',.0f')} |"
    )


def priority(args: argparse.Namespace) -> None:
    """The batch flood with each router over engines that schedule first come first served (vLLM's
    default) and by priority (vLLM's priority scheduler, which every baseline here runs on too)."""
    print(f"seeds {args.seeds}; views {args.views}; heartbeat {args.heartbeat_s:g} s")
    w = batch_flood()
    with ProcessPoolExecutor(args.jobs) as pool:
        for views in args.views:
            futures = {
                (router, scheduling): [
                    pool.submit(
                        run_one, Run("batch-flood", (), router, s, views, 8, args.heartbeat_s, scheduling)
                    )
                    for s in args.seeds
                ]
                for router in args.routers
                for scheduling in ("fcfs", "priority")
            }
            print(f"\n**{w.name}: {w.description}; 8 replicas, {w.duration_s:.0f} s; {views} views**\n")
            print(PRIORITY_HEADER)
            print("| --- " * 10 + "|")
            for (router, scheduling), fs in futures.items():
                print(priority_row(router, scheduling, [f.result() for f in fs]), flush=True)


LORA_HEADER = (
    "| router | p50 TTFT ms | p90 TTFT ms | p99 TTFT s | tokens/s | adapter loads per minute | SLO met "
    "| unfinished |"
)


def lora_row(name: str, results: list[Result], minutes: float) -> str:
    s = [r.summary for r in results]
    loads = [r.extra["adapter_loads"] / minutes for r in results]
    return (
        f"| {name} | {spread([x.ttft_p50 for x in s], ttft_ms)} | {spread([x.ttft_p90 for x in s], ttft_ms)} "
        f"| {spread([x.ttft_p99 for x in s], '.2f')} | {spread([x.tokens_per_s for x in s], ',.0f')} "
        f"| {spread(loads, ',.0f')} | {spread([x.slo_attainment * 100 for x in s], '.1f')}% "
        f"| {spread([float(r.unfinished) for r in results], '.0f')} |"
    )


def lora(args: argparse.Namespace) -> None:
    """Many adapters on one pool: every router over replicas that hold `max_loras` 8 adapters each."""
    print(f"seeds {args.seeds}; views {args.views}; heartbeat {args.heartbeat_s:g} s")
    routers = args.routers if args.routers != list(ROUTERS) else ["sluice", *LORA_ROUTERS, *ROUTERS[1:]]
    with ProcessPoolExecutor(args.jobs) as pool:
        for views in args.views:
            for rate in args.lora_rates:
                kwargs = (("rate", rate), ("duration_s", args.duration))
                w = lora_zipf(rate=rate, duration_s=args.duration)
                runs = {
                    router: [Run("lora-zipf", kwargs, router, s, views, 8, args.heartbeat_s, max_loras=8)
                             for s in args.seeds]
                    for router in routers
                }  # fmt: skip
                title = f"{w.description}; 8 replicas x 8 adapters, {w.duration_s:.0f} s; {views} views"
                row = functools.partial(lora_row, minutes=w.duration_s / 60)
                run_table(title, runs, pool, LORA_HEADER, row)


SCALERS = ("sluice", "keda", "reactive", "dynamo-planner", "dynamo-planner-agg", "llm-d-wva")
SCALING_HEADER = (
    "| scaler | setting | SLO-violation minutes | GPU-hours | p90 TTFT s | p99 TTFT s | peak replicas "
    "| unfinished |"
)


@dataclass(frozen=True)
class ScalingRun:
    scaler: str
    setting: float
    seed: int
    peak: float
    day_s: float
    startup: float
    capacity: float
    prior_startup: float
    variant: str = ""


def make_scaler(run: ScalingRun) -> Scaler:
    model = TimingModel(max_seqs=64)
    if run.scaler == "sluice":
        policy = ScalingPolicy(
            min_replicas=1, max_replicas=64, queue_slo_s=30, target_utilization=run.setting
        )
        return SluiceScaler(policy, capacity_default=run.capacity, startup_s=run.prior_startup)
    if run.scaler == "keda":
        return KedaScaler(1, 64, lag_threshold=int(run.setting))
    if run.scaler == "reactive":
        return ReactiveScaler(1, 64, concurrency=model.max_seqs, target=run.setting)
    if run.scaler == "dynamo-planner":
        # The profiled TTFT: one step with a 1,350-token prompt of which 1,000 are cached, at 64 running.
        expected = model.decode_base_s + 64 * model.decode_per_seq_s + 350 * model.prefill_per_token_s
        return DynamoPlannerScaler(
            1, 64, run.capacity, expected_ttft_s=expected, interval_s=run.setting,
            correction=run.variant != "no correction",
        )  # fmt: skip
    if run.scaler == "dynamo-planner-agg":
        return DynamoAggPlannerScaler(1, 64, itl_s=run.setting / 1000)
    if run.scaler == "llm-d-wva":
        return LlmdWvaScaler(1, 64, every_s=run.setting)
    raise ValueError(run.scaler)


def scaling_one(run: ScalingRun) -> tuple[int, float, float, float, int, int]:
    w = diurnal(peak=run.peak, day_s=run.day_s)
    out: Outcome = simulate(
        functools.partial(make_router, "sluice", run.seed), TimingModel(max_seqs=64), w.requests,
        w.duration_s, 1, seed=run.seed, scaler=make_scaler(run), startup_s=run.startup, heartbeat_s=1.0,
        by_minute=True,
    )  # fmt: skip
    s = summarize(out)
    minutes = violation_minutes(out.stats, w.duration_s, 2.0, out.unfinished)
    peak = max((ready + starting for _, ready, starting, _ in out.timeline), default=0)
    return minutes, s.gpu_hours, s.ttft_p90, s.ttft_p99, peak, out.unfinished


def scaling_settings(args: argparse.Namespace) -> list[tuple[str, str, float, str, float]]:
    """(rule, setting as printed, knob value, variant, profiled requests/s per replica) for every point of
    the frontier. Dynamo's planner sizes the fleet from the throughput its profiler measured at the user's
    latency targets; tighter targets profile a lower throughput, so that profile is the knob its users turn
    (beside the adjustment interval)."""
    c = args.capacity
    settings: list[tuple[str, str, float, str, float]] = [
        *[("sluice", f"target utilisation {u:g}", u, "", c) for u in args.sluice_targets],
        *[("keda", f"lagThreshold {t}", float(t), "", c) for t in args.lag_thresholds],
        *[("reactive", f"HPA target {u:g} of 64", u, "", c) for u in args.reactive_targets],
        *[
            ("dynamo-planner", f"{variant}, every {i:g} s, profile {p:g} req/s", float(i), variant, p)
            for variant in args.planner_variants
            for i in args.planner_intervals
            for p in args.planner_capacities
        ],
        *[("dynamo-planner-agg", f"load-based, ITL target {t:g} ms", t, "", c) for t in args.agg_itl_targets],
        *[("llm-d-wva", f"every {e:g} s", float(e), "", c) for e in args.wva_intervals],
    ]
    return [row for row in settings if row[0] in args.scalers]


def scaling(args: argparse.Namespace) -> None:
    settings = scaling_settings(args)
    print(
        f"\ndiurnal: peak {args.peak:g} req/s, day of {args.day_s / 3600:.0f} h, "
        f"start-up {args.startup:.0f} s; seeds {args.seeds}; "
        f"sluice's start-up prior {args.prior_startup:.0f} s (it measures the real one)"
    )
    print(SCALING_HEADER)
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    points: dict[str, list[tuple[str, float, float]]] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {
            (kind, label): [
                pool.submit(scaling_one, ScalingRun(kind, value, seed, args.peak, args.day_s, args.startup,
                                                    capacity, args.prior_startup, variant))
                for seed in args.seeds
            ]
            for kind, label, value, variant, capacity in settings
        }  # fmt: skip
        for (kind, label), fs in futures.items():
            rows = [f.result() for f in fs]
            minutes = statistics.median(r[0] for r in rows)
            hours = statistics.median(r[1] for r in rows)
            points.setdefault(kind, []).append((label, hours, minutes))
            print(
                f"| {kind} | {label} | {spread([r[0] for r in rows], '.0f')} "
                f"| {spread([r[1] for r in rows], '.0f')} | {spread([r[2] for r in rows], '.3f')} "
                f"| {spread([r[3] for r in rows], '.2f')} | {spread([r[4] for r in rows], '.0f')} "
                f"| {spread([r[5] for r in rows], '.0f')} |",
                flush=True,
            )
    if args.plots:
        plot_frontier(points, args, args.plots / "sim_scaling_frontier.png")


def scaling_points(table: str) -> dict[str, list[tuple[str, float, float]]]:
    """(setting, GPU-hours, violation-minutes) per rule, from the medians of tables `scaling` printed."""
    points: dict[str, list[tuple[str, float, float]]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or cells[0] not in SCALERS:
            continue
        minutes, hours = (float(c.split(" [", 1)[0]) for c in (cells[2], cells[3]))
        points.setdefault(cells[0], []).append((cells[1], hours, minutes))
    return points


def frontier(args: argparse.Namespace) -> None:
    """The frontier plot from tables printed by `scaling` runs (`--tables`), for rules run separately."""
    if not args.plots:
        raise SystemExit("frontier: --plots names the folder for the plot")
    points: dict[str, list[tuple[str, float, float]]] = {}
    for path in args.tables:
        for kind, rows in scaling_points(path.read_text()).items():
            points.setdefault(kind, []).extend(rows)
    if not points:
        raise SystemExit("frontier: no scaling rows in the tables given")
    plot_frontier(points, args, args.plots / "sim_scaling_frontier.png")


def scale(args: argparse.Namespace) -> None:
    w = shared_prefix(rate=args.rate, tenants=1200, duration_s=3600)
    t0 = time.perf_counter()
    out = simulate(lambda: make_router("sluice", args.seed), TimingModel(), w.requests, w.duration_s, 64)
    wall = time.perf_counter() - t0
    s = summarize(out)
    print(f"\n64 replicas, 1 simulated hour, {w.description}; heartbeat views")
    print(PLACEMENT_HEADER)
    print("| --- " * 9 + "|")
    print(placement_row("sluice", [Result(s, out.unfinished)]))
    rate = s.finished / wall
    print(f"{s.finished:,} requests simulated in {wall:.0f} s of wall time ({rate:,.0f} requests/s)")


def model_error_one(run: Run) -> tuple[float, float, int]:
    """The sluice router's latency-model error on one run: the median and 90th percentile of
    |observed - predicted| / observed over its placements' first tokens, and how many there were."""
    w = WORKLOADS[run.workload](**dict(run.kwargs))
    routers: list[SluiceRouter] = []

    def factory() -> Router:
        router = SluiceRouter(PlacementPolicy(), random.Random(run.seed))
        routers.append(router)
        return router

    simulate(factory, TimingModel(), w.requests, w.duration_s, run.replicas, seed=run.seed,
             heartbeat_s=run.heartbeat_s, views=run.views)  # fmt: skip
    errors = sorted(routers[0].errors)
    if not errors:
        return math.nan, math.nan, 0
    return statistics.median(errors), errors[int(0.9 * (len(errors) - 1))], len(errors)


def model_error(args: argparse.Namespace) -> None:
    """How far the latency model's corrected prediction is from the first token observed."""
    cases = [
        ("shared-prefix", (("rate", 30.0), ("duration_s", args.duration))),
        ("shared-prefix", (("rate", 60.0), ("duration_s", args.duration))),
        ("shared-prefix", (("rate", 90.0), ("duration_s", args.duration))),
        ("multi-turn", (("duration_s", args.duration),)),
        ("bursty-code", (("duration_s", args.duration),)),
    ]
    print("| workload | views | median relative error | 90th percentile | first tokens |")
    print("| --- | --- | --- | --- | --- |")
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, kwargs in cases:
            for views in args.views:
                runs = [Run(name, kwargs, "sluice", seed, views, 8, args.heartbeat_s) for seed in args.seeds]
                rows = list(pool.map(model_error_one, runs))
                label = name + "".join(f", {v:g} req/s" for k, v in kwargs if k == "rate")
                print(
                    f"| {label} | {views} | {spread([r[0] for r in rows], '.0%')} "
                    f"| {spread([r[1] for r in rows], '.0%')} | {sum(r[2] for r in rows):,} |",
                    flush=True,
                )


def llmd(args: argparse.Namespace) -> None:
    from bench.sim.llmd_experiment import main as experiment

    experiment(args.seeds, args.jobs)


def auto_setting(text: str) -> str:
    """`W` or `W:M` (a stall weight, and the least uncached tokens to split), checked at parse time."""
    weight, _, least = text.partition(":")
    try:
        if float(weight) < 0 or (least and int(least) < 1):
            raise ValueError(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want W or W:M, W >= 0 and M >= 1 tokens") from None
    return text


def disagg(args: argparse.Namespace) -> None:
    from bench.sim.disagg import main as experiment

    experiment(
        args.seeds, args.jobs, args.duration, args.loads, args.all, args.disagg_workloads,
        args.thresholds, args.auto_settings,
    )  # fmt: skip


def line_style(n: int) -> dict[str, Any]:
    """The n-th line's style: matplotlib's ten colours repeat, so each ten lines take the next dash and
    marker and no two lines look alike."""
    return {"linestyle": ("-", "--", ":", "-.")[n // 10 % 4], "marker": "osD^v"[n // 10 % 5]}


def plot_placement(by_views: dict[str, dict[float, dict[str, list[Result]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_views), figsize=(6 * len(by_views), 4.5), squeeze=False)
    for ax, (views, by_rate) in zip(axes[0], by_views.items(), strict=True):
        rates = sorted(by_rate)
        for n, name in enumerate(by_rate[rates[0]]):
            p90 = [statistics.median(r.summary.ttft_p90 for r in by_rate[rate][name]) for rate in rates]
            ax.plot(rates, p90, label=name, **line_style(n))
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate, requests/s (8 replicas)")
        ax.set_ylabel("p90 time to first token, s (log; median of seeds)")
        ax.set_title(f"Shared prefix, {views} views")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_frontier(
    points: dict[str, list[tuple[str, float, float]]], args: argparse.Namespace, path: Path
) -> None:
    """Each rule's violation-minutes against its GPU-hours, one point per knob setting (medians of the
    seeds), joined in order of GPU-hours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    n = 0
    for kind, rows in points.items():
        by_variant: dict[str, list[tuple[str, float, float]]] = {}
        for label, hours, minutes in rows:
            variant = label.rsplit(", profile ", 1)[0] if kind == "dynamo-planner" else ""
            by_variant.setdefault(variant, []).append((label, hours, minutes))
        for variant, pts in by_variant.items():
            pts.sort(key=lambda p: p[1])  # settings run apart arrive in any order
            name = f"{kind} ({variant})" if variant else kind
            ax.plot([h for _, h, _ in pts], [m for _, _, m in pts], label=name, **line_style(n))
            n += 1
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=10)  # linear up to 10 minutes, where the rules that hold the SLO differ
    ax.set_ylim(bottom=0)
    ticks = [0, 2, 4, 6, 8, 10, 20, 50, 100, 200, 500, 1000]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.set_xticks([50, 100, 200, 500, 1000, 2000], ["50", "100", "200", "500", "1000", "2000"])
    ax.set_xlabel("GPU-hours (replica-hours) over the day, log scale")
    ax.set_ylabel("SLO-violation minutes (p90 TTFT over 2 s), linear to 10 then log")
    ax.set_title(
        f"Scaling rules on a diurnal day (peak {args.peak:g} req/s, {args.startup:.0f} s start-up): "
        "lower left is better",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "experiment",
        choices=[
            "placement",
            "workloads",
            "priority",
            "scaling",
            "frontier",
            "llmd",
            "scale",
            "lora",
            "disagg",
            "error",
        ],
    )
    parser.add_argument("--seed", type=int, default=1, help="for `scale`")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--jobs", type=int, default=2, help="processes to run the runs in")
    names = sorted({*ROUTERS, *LORA_ROUTERS, *(f"{family}-tuned" for family in TUNABLE)})
    parser.add_argument("--routers", nargs="+", choices=names, default=list(ROUTERS))
    parser.add_argument("--views", nargs="+", choices=["exact", "heartbeat"], default=["heartbeat", "exact"])
    parser.add_argument("--heartbeat-s", type=float, default=0.5, help="age bound of heartbeat views")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic per run")
    parser.add_argument("--rates", type=float, nargs="+", default=[30.0, 60.0, 90.0])
    parser.add_argument("--rate", type=float, default=300.0, help="requests/s for `scale`")
    parser.add_argument("--lora-rates", type=float, nargs="+", default=[20.0, 40.0], help="for `lora`")
    parser.add_argument("--peak", type=float, default=60.0, help="peak requests/s of the diurnal day")
    parser.add_argument("--day-s", type=float, default=6 * 3600.0, help="length of the simulated day")
    parser.add_argument("--startup", type=float, default=180.0, help="the replicas' real start-up")
    parser.add_argument("--prior-startup", type=float, default=60.0, help="sluice's start-up before measured")
    parser.add_argument("--capacity", type=float, default=9.0, help="profiled requests/s per replica")
    parser.add_argument("--lag-thresholds", type=int, nargs="+", default=[10, 50, 100, 200, 400, 800])
    parser.add_argument("--sluice-targets", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9])
    parser.add_argument("--reactive-targets", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9])
    parser.add_argument("--planner-intervals", type=float, nargs="+", default=[180.0, 60.0])
    parser.add_argument(
        "--planner-capacities", type=float, nargs="+", default=[9.0, 6.0, 4.5],
        help="Dynamo's planner: profiled requests/s per replica (lower for tighter latency targets)",
    )  # fmt: skip
    parser.add_argument(
        "--planner-variants", nargs="+", choices=["corrected", "no correction"],
        default=["corrected", "no correction"],
    )  # fmt: skip
    parser.add_argument(
        "--agg-itl-targets", type=float, nargs="+", default=[50.0, 30.0],
        help="Dynamo's aggregated planner: ITL targets in ms (its TTFT target stays 500 ms)",
    )  # fmt: skip
    parser.add_argument("--wva-intervals", type=float, nargs="+", default=[60.0, 30.0])
    parser.add_argument(
        "--scalers", nargs="+", default=list(SCALERS), choices=SCALERS, help="for `scaling`: which rules"
    )
    parser.add_argument("--loads", type=float, nargs="+", default=[1.0, 1.5], help="for `disagg`: x rates")
    parser.add_argument("--all", action="store_true", help="for `disagg`: every configuration, not the best")
    parser.add_argument(
        "--thresholds", type=int, nargs="+", default=list(DISAGG_THRESHOLDS),
        help="for `disagg`: llm-d's thresholds T (uncached prompt tokens) to sweep",
    )  # fmt: skip
    parser.add_argument(
        "--auto-settings", nargs="+", default=list(DISAGG_AUTO), type=auto_setting,
        help="for `disagg`: sluice's stall weights W, or W:M with M the least uncached tokens to split",
    )  # fmt: skip
    parser.add_argument(
        "--disagg-workloads", nargs="+", choices=DISAGG_WORKLOADS, default=list(DISAGG_WORKLOADS),
        help="for `disagg`: which workloads",
    )  # fmt: skip
    parser.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    parser.add_argument(
        "--tables", type=Path, nargs="+", default=[], help="for `frontier`: `scaling` outputs"
    )
    args = parser.parse_args()
    experiments = {
        "placement": placement, "workloads": workloads, "priority": priority, "scaling": scaling,
        "frontier": frontier,
        "llmd": llmd, "scale": scale, "lora": lora, "disagg": disagg, "error": model_error,
    }  # fmt: skip
    experiments[args.experiment](args)


if __name__ == "__main__":
    main()
