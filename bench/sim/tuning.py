"""Each router's main knob, swept the same way: four settings per router at 60 and 90 req/s on the
shared-prefix workload (300 s, seed 1, views per design), and the setting with the lowest p90 time to
first token summed over the two rates (the default among equals). The chosen values are
`routers.TUNED`; the tables show each tuned router beside its default. SGLang's knob is its balance
threshold: its cache threshold makes no difference here, where a prompt matches 0 or over 0.9.

Run: `.venv/bin/python -m bench.sim.tuning [--rates 60 90] [--duration 300] [--seed 1]`.
"""

from __future__ import annotations

import argparse
import functools
from concurrent.futures import ProcessPoolExecutor

from bench.sim.engine import TimingModel
from bench.sim.fleet import simulate
from bench.sim.metrics import Summary, summarize
from bench.sim.routers import Router, knob_router
from bench.sim.workloads import shared_prefix

DEFAULTS = {"sluice": 5.0, "llm-d": 3.0, "sglang": 64.0, "dynamo": 1.0, "llm-d-predicted": 0.8}
SWEEPS: dict[str, tuple[str, tuple[float, ...]]] = {
    "sluice": ("prefix weight", (2.0, 3.0, 5.0, 8.0)),
    "llm-d": ("prefix weight (kv 2, queue 2)", (1.0, 3.0, 5.0, 8.0)),
    "sglang": ("balance_abs_threshold", (64.0, 128.0, 256.0, 1e6)),
    "dynamo": ("prefill_load_scale", (1.0, 2.0, 4.0, 8.0)),
    "llm-d-predicted": ("affinity threshold", (0.5, 0.7, 0.8, 0.9)),
}


def _router(family: str, value: float, seed: int) -> Router:
    import random

    return knob_router(family, value, random.Random(seed))


def one(family: str, value: float, rate: float, duration_s: float, seed: int) -> Summary:
    w = shared_prefix(rate=rate, duration_s=duration_s)
    out = simulate(
        functools.partial(_router, family, value, seed), TimingModel(), w.requests, w.duration_s, 8,
        seed=seed, views="heartbeat",
    )  # fmt: skip
    return summarize(out)


def best(p90s: dict[float, list[float]], default: float) -> float:
    """The setting whose p90s summed over the rates are lowest; the default among equals."""
    return min(p90s, key=lambda value: (sum(p90s[value]), value != default))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[60.0, 90.0])
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--routers", nargs="+", default=list(SWEEPS), choices=list(SWEEPS))
    args = parser.parse_args()
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {
            (family, value, rate): pool.submit(one, family, value, rate, args.duration, args.seed)
            for family in args.routers
            for value in SWEEPS[family][1]
            for rate in args.rates
        }
        print(f"shared prefix, 8 replicas, {args.duration:g} s, seed {args.seed}, views per design")
        rates = " | ".join(f"{r:g} req/s p90 ms / hits" for r in args.rates)
        print(f"| router | knob | value | {rates} |")
        print("| --- | --- | --- |" + " --- |" * len(args.rates))
        for family in args.routers:
            knob, values = SWEEPS[family]
            p90s: dict[float, list[float]] = {}
            for value in values:
                cells = []
                for rate in args.rates:
                    summary = futures[(family, value, rate)].result()
                    p90s.setdefault(value, []).append(summary.ttft_p90)
                    cells.append(f"{summary.ttft_p90 * 1000:,.1f} / {summary.hit_rate * 100:.0f}%")
                print(f"| {family} | {knob} | {value:g} | {' | '.join(cells)} |", flush=True)
            chosen = best(p90s, DEFAULTS[family])
            print(f"| {family} | best | **{chosen:g}** |" + " |" * len(args.rates), flush=True)


if __name__ == "__main__":
    main()
