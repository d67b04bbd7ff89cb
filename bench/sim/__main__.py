"""`python -m bench.sim EXPERIMENT`: run the fleet simulator and print its tables (and draw its plots).

- placement: every router on the shared-prefix workload at several rates (8 replicas);
- workloads: every router on multi-turn chat, bursty code completion and a batch flood;
- scaling: the three scaling rules on a diurnal day, 3-minute start-up;
- seeds: the cache-aware routers on the shared-prefix workload, one row per seed (traffic and router);
- scale: 64 replicas and one hour of shared-prefix traffic, timed.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path

from bench.sim.engine import TimingModel
from bench.sim.fleet import Outcome, Scaler, simulate
from bench.sim.metrics import Summary, summarize, violation_minutes
from bench.sim.routers import ROUTERS, make_router
from bench.sim.scalers import KedaScaler, ReactiveScaler, SluiceScaler
from bench.sim.workloads import (
    Workload,
    batch_flood,
    bursty_code,
    diurnal,
    diurnal_rate,
    multi_turn,
    shared_prefix,
)
from dispatcher.placement import PlacementPolicy
from scaler.policy import ScalingPolicy

_DEFAULT = PlacementPolicy()
DEFAULT_WEIGHTS = [_DEFAULT.prefix_weight, _DEFAULT.kv_weight, _DEFAULT.queue_weight]

HEADER = (
    "| router | p50 TTFT ms | p90 TTFT ms | p99 TTFT s | p90 ITL ms | tokens/s | prefix hits | SLO met "
    "| unfinished |"
)


SCALING_HEADER = (
    "| scaler | SLO-violation minutes | GPU-hours | p90 TTFT s | p99 TTFT s | peak replicas | unfinished |"
)


def row(name: str, s: Summary, out: Outcome) -> str:
    return (
        f"| {name} | {s.ttft_p50 * 1000:,.1f} | {s.ttft_p90 * 1000:,.1f} | {s.ttft_p99:.2f} | "
        f"{s.itl_p90 * 1000:.0f} | {s.tokens_per_s:,.0f} | {s.hit_rate:.0%} | {s.slo_attainment:.1%} | "
        f"{out.unfinished} |"
    )


def compare(workload: Workload, replicas: int, model: TimingModel, seed: int) -> dict[str, Summary]:
    print(f"\n{workload.name}: {workload.description}; {replicas} replicas, {workload.duration_s:.0f} s")
    print(HEADER)
    print("| --- " * 9 + "|")
    results = {}
    for name in ROUTERS:
        out = simulate(
            functools.partial(make_router, name, seed),
            model,
            workload.requests,
            workload.duration_s,
            replicas,
        )
        results[name] = summarize(out)
        print(row(name, results[name], out), flush=True)
    return results


def placement(args: argparse.Namespace) -> None:
    model = TimingModel()
    by_rate = {}
    for rate in args.rates:
        by_rate[rate] = compare(shared_prefix(rate=rate, duration_s=args.duration), 8, model, args.seed)
    if args.plots:
        plot_placement(by_rate, args.plots / "sim_placement.png")


def seeds(args: argparse.Namespace) -> None:
    """p90 and p99 TTFT of each cache-aware router for each seed of traffic and router, and its cold
    placements (requests that found none of their prompt cached on the replica they were sent to).

    At low load the cache-aware routers' p90 differ by less than a tenth of a millisecond; this shows by
    how much, seed by seed.
    """
    model = TimingModel()
    prefix, kv, queue = args.weights
    policy = PlacementPolicy(prefix_weight=prefix, kv_weight=kv, queue_weight=queue)
    for rate in args.rates:
        w = shared_prefix(rate=rate, duration_s=args.duration)
        print(f"\n{w.name}: {w.description}; 8 replicas, {w.duration_s:.0f} s")
        print(
            f"sluice's weights: prefix {prefix:g}, KV {kv:g}, queue {queue:g}; "
            f"heartbeats every {args.heartbeat_s:g} s"
        )
        print("each cell: p90 TTFT ms / p99 TTFT s / cold placements")
        print("| seed | " + " | ".join(args.routers) + " | best p90 |")
        print("| --- " * (len(args.routers) + 2) + "|")
        for seed in args.seeds:
            cells, p90 = [], {}
            for name in args.routers:
                out = simulate(
                    functools.partial(make_router, name, seed, policy), model, w.requests, w.duration_s, 8,
                    seed=seed, heartbeat_s=args.heartbeat_s,
                )  # fmt: skip
                s = summarize(out)
                p90[name] = s.ttft_p90
                cold = sum(1 for r in out.requests if r.cached_tokens == 0)
                cells.append(f"{s.ttft_p90 * 1000:,.2f} / {s.ttft_p99:.2f} / {cold}")
            print(f"| {seed} | " + " | ".join(cells) + f" | {min(p90, key=p90.__getitem__)} |", flush=True)


def workloads(args: argparse.Namespace) -> None:
    model = TimingModel()
    for w in (multi_turn(duration_s=args.duration), bursty_code(duration_s=args.duration), batch_flood()):
        compare(w, 8, model, args.seed)


def scaling(args: argparse.Namespace) -> None:
    model = TimingModel(max_seqs=64)
    w = diurnal(peak=args.peak, day_s=args.day_s)
    factories: dict[str, Callable[[], Scaler]] = {
        "sluice": lambda: SluiceScaler(
            ScalingPolicy(min_replicas=1, max_replicas=64, queue_slo_s=30, target_utilization=0.8),
            capacity_default=args.capacity, startup_s=args.startup,
        ),
        "keda": lambda: KedaScaler(1, 64),
        "reactive": lambda: ReactiveScaler(1, 64, concurrency=64),
    }  # fmt: skip
    print(f"\ndiurnal: {w.description}, day of {args.day_s / 3600:.0f} h, start-up {args.startup:.0f} s")
    print(SCALING_HEADER)
    print("| --- | --- | --- | --- | --- | --- | --- |")
    timelines = {}
    for name, factory in factories.items():
        out = simulate(
            lambda: make_router("sluice", args.seed), model, w.requests, w.duration_s, 1,
            seed=args.seed, scaler=factory(), startup_s=args.startup, heartbeat_s=1.0,
        )  # fmt: skip
        s = summarize(out)
        minutes = violation_minutes(out.requests, w.duration_s, 2.0, out.unfinished)
        peak = max((ready + starting for _, ready, starting, _ in out.timeline), default=0)
        print(
            f"| {name} | {minutes} | {s.gpu_hours:.0f} | {s.ttft_p90:.3f} | {s.ttft_p99:.2f} | {peak} | "
            f"{out.unfinished} |",
            flush=True,
        )
        timelines[name] = out.timeline
    if args.plots:
        plot_scaling(timelines, args, args.plots / "sim_scaling.png")


def scale(args: argparse.Namespace) -> None:
    w = shared_prefix(rate=args.rate, tenants=1200, duration_s=3600)
    t0 = time.perf_counter()
    out = simulate(lambda: make_router("sluice", args.seed), TimingModel(), w.requests, w.duration_s, 64)
    wall = time.perf_counter() - t0
    s = summarize(out)
    print(f"\n64 replicas, 1 simulated hour, {w.description}")
    print(HEADER)
    print("| --- " * 9 + "|")
    print(row("sluice", s, out))
    rate = s.finished / wall
    print(f"{s.finished:,} requests simulated in {wall:.0f} s of wall time ({rate:,.0f} requests/s)")


def plot_placement(by_rate: dict[float, dict[str, Summary]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rates = sorted(by_rate)
    for name in ROUTERS:
        ax.plot(rates, [by_rate[r][name].ttft_p90 for r in rates], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate, requests/s (8 replicas)")
    ax.set_ylabel("p90 time to first token, s (log)")
    ax.set_title("Shared-prefix workload: 150 tenants x 6k-token context")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_scaling(
    timelines: dict[str, list[tuple[float, int, int, int]]], args: argparse.Namespace, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, timeline in timelines.items():
        ax.step(
            [t / 3600 for t, *_ in timeline], [r + s for _, r, s, _ in timeline], where="post", label=name
        )
    ax2 = ax.twinx()
    hours = [i / 60 for i in range(int(args.day_s / 60))]
    ax2.plot(hours, [diurnal_rate(h * 3600, args.peak, args.day_s) for h in hours], color="grey", alpha=0.4)
    ax2.set_ylabel("arrival rate, requests/s (grey)")
    ax.set_xlabel("hour of the simulated day")
    ax.set_ylabel("replicas (ready + starting)")
    ax.set_title(f"Diurnal day, {args.startup:.0f} s start-up")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiment", choices=["placement", "workloads", "scaling", "seeds", "scale"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="for `seeds`")
    parser.add_argument(
        "--routers", nargs="+", choices=ROUTERS, default=["sluice", "sglang", "llm-d", "dynamo"],
        help="for `seeds`",
    )  # fmt: skip
    parser.add_argument(
        "--weights", type=float, nargs=3, metavar=("PREFIX", "KV", "QUEUE"), default=DEFAULT_WEIGHTS,
        help="sluice's placement weights, for `seeds` (default: the dispatcher's)",
    )  # fmt: skip
    parser.add_argument("--heartbeat-s", type=float, default=0.5, help="heartbeat period, for `seeds`")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic per run")
    parser.add_argument("--rates", type=float, nargs="+", default=[30.0, 60.0, 90.0])
    parser.add_argument("--rate", type=float, default=300.0, help="requests/s for `scale`")
    parser.add_argument("--peak", type=float, default=60.0, help="peak requests/s of the diurnal day")
    parser.add_argument("--day-s", type=float, default=6 * 3600.0, help="length of the simulated day")
    parser.add_argument("--startup", type=float, default=180.0)
    parser.add_argument("--capacity", type=float, default=9.0, help="requests/s per replica, before measured")
    parser.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    args = parser.parse_args()
    experiments = {
        "placement": placement, "workloads": workloads, "scaling": scaling, "seeds": seeds, "scale": scale,
    }  # fmt: skip
    experiments[args.experiment](args)


if __name__ == "__main__":
    main()
