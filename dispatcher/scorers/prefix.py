"""Prefix affinity: the share of the request's prompt blocks the worker holds in its KV cache. Weight 5:
llm-d's prefix scorer weighs 3; the fleet simulator (`python -m bench.sim`) found 5 shortens multi-turn
TTFT with nothing else changed."""

from __future__ import annotations

from dispatcher.scorers import Candidates, Floats, register


@register("prefix", 5.0)
def prefix(candidates: Candidates) -> Floats:
    return candidates.prefix_ratio
