"""How a Dynamo user would tune its KV router for long shared prefixes: `--router-prefill-load-scale` and
the router queue, swept on the shared-prefix workload. The best setting is `dynamo-tuned` in the tables.

Run: `.venv/bin/python -m bench.sim.dynamo_sweep [--rates 60 90] [--duration 300] [--seed 1]`.
"""

from __future__ import annotations

import argparse
import functools
import random
from concurrent.futures import ProcessPoolExecutor

from bench.sim.engine import TimingModel
from bench.sim.fleet import simulate
from bench.sim.metrics import Summary, summarize
from bench.sim.routers import DynamoRouter
from bench.sim.workloads import shared_prefix

SCALES = (1.0, 2.0, 4.0, 8.0)
QUEUES = (4.0, None)  # the Python binding's router_queue_threshold default, and no router queue


def dynamo(seed: int, scale: float, queue: float | None) -> DynamoRouter:
    return DynamoRouter(random.Random(seed), prefill_load_scale=scale, queue_threshold=queue)


def one(rate: float, duration_s: float, seed: int, scale: float, queue: float | None) -> Summary:
    w = shared_prefix(rate=rate, duration_s=duration_s)
    out = simulate(
        functools.partial(dynamo, seed, scale, queue), TimingModel(), w.requests, w.duration_s, 8, seed=seed,
        heartbeat_s=0.5, views="heartbeat",
    )  # fmt: skip
    return summarize(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[60.0, 90.0])
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    settings = [(scale, queue) for scale in SCALES for queue in QUEUES]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {
            (s, q, rate): pool.submit(one, rate, args.duration, args.seed, s, q)
            for s, q in settings
            for rate in args.rates
        }
        print(f"shared prefix, 8 replicas, {args.duration:g} s, seed {args.seed}, heartbeat views")
        rates = " | ".join(f"{r:g} req/s p90 / hits" for r in args.rates)
        print(f"| prefill_load_scale | router queue | {rates} |")
        print("| --- | --- |" + " --- |" * len(args.rates))
        for s, q in settings:
            cells = []
            for rate in args.rates:
                summary = futures[(s, q, rate)].result()
                cells.append(f"{summary.ttft_p90:.3g} s / {summary.hit_rate * 100:.0f}%")
            print(f"| {s:g} | {'off' if q is None else f'{q:g}'} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
