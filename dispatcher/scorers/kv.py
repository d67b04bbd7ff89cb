"""KV headroom: the worker's free KV fraction once the request is placed, clipped to [0, 1]. Weight 2, as
llm-d's KV-cache utilisation scorer."""

from __future__ import annotations

import numpy as np

from dispatcher.scorers import Candidates, Floats, register


@register("kv", 2.0)
def kv(candidates: Candidates) -> Floats:
    return np.clip(candidates.headroom, 0.0, 1.0)
