"""Placement scorers. Each turns what placement knows of the workers that can take a request into one
term per worker, in [0, 1]; the decision is their weighted sum (`PlacementPolicy.weights`, the
dispatcher's `scorer_weights` setting). A scorer is one module here that registers itself with
`register`, and one name in the import line at the end of this file; the readable reference
(`placement.choose`) and the columnar path that runs (`table.choose_fast`) both score through
`weighted_sum`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Candidates:
    """What the scorers see of the workers, one entry per worker."""

    prefix_ratio: Floats  # the share of the prompt's blocks the worker holds
    headroom: Floats  # its free KV fraction once the request is placed (may be below 0)
    queue: Floats  # requests waiting at it, including those placed since its heartbeat
    queue_lo: float  # the shortest and longest queue among the workers that can take the request
    queue_hi: float
    adapter_held: Floats  # 1 where it holds the request's LoRA adapter, or the request names none


Scorer = Callable[[Candidates], Floats]

SCORERS: dict[str, Scorer] = {}
DEFAULT_WEIGHTS: dict[str, float] = {}


def register(name: str, default_weight: float) -> Callable[[Scorer], Scorer]:
    """Register a scorer under `name`, weighted `default_weight` unless the settings say otherwise."""

    def add(scorer: Scorer) -> Scorer:
        SCORERS[name] = scorer
        DEFAULT_WEIGHTS[name] = default_weight
        return scorer

    return add


def weighted_sum(candidates: Candidates, weights: Mapping[str, float]) -> Floats:
    """Each worker's score: the sum of every scorer's term times its weight."""
    total = np.zeros(len(candidates.queue))
    for name, weight in weights.items():
        if weight:
            total = total + weight * SCORERS[name](candidates)
    return total


def weights_problem(weights: Mapping[str, float]) -> str | None:
    """Why `weights` cannot be used: a name no scorer has, or a negative weight."""
    for name, weight in weights.items():
        if name not in SCORERS:
            return f"no scorer is named {name!r} (there are: {', '.join(sorted(SCORERS))})"
        if weight < 0:
            return f"the weight of {name!r} is negative"
    return None


def default_weights() -> dict[str, float]:
    return dict(DEFAULT_WEIGHTS)


from dispatcher.scorers import prefix, kv, queue, adapter  # noqa: E402, F401, I001  (each registers itself)
