"""Queue: 1 for the shortest queue among the workers that can take the request, 0 for the longest, in
between by rank of length; all 1 when they are equal. Weight 2, as llm-d's queue scorer."""

from __future__ import annotations

import numpy as np

from dispatcher.scorers import Candidates, Floats, register


@register("queue", 2.0)
def queue(candidates: Candidates) -> Floats:
    lo, hi = candidates.queue_lo, candidates.queue_hi
    if hi == lo:
        return np.ones(len(candidates.queue))
    return (hi - candidates.queue) / (hi - lo)
