"""`python -m gpu_workers --pool P --worker-id W`: one worker, as the scaler's local backend starts it."""

from __future__ import annotations

import argparse

from gpu_workers.main import run
from gpu_workers.settings import WorkerSettings


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_workers", description=__doc__)
    parser.add_argument("--pool")
    parser.add_argument("--worker-id")
    args = parser.parse_args()
    overrides = {k: v for k, v in {"pool": args.pool, "worker_id": args.worker_id}.items() if v is not None}
    run(WorkerSettings(**overrides))


if __name__ == "__main__":
    main()
