"""LoRA adapter: 1 on a worker that holds the request's adapter (one that does not must load it first),
and on every worker for a request without one. Weight 3."""

from __future__ import annotations

from dispatcher.scorers import Candidates, Floats, register


@register("adapter", 3.0)
def adapter(candidates: Candidates) -> Floats:
    return candidates.adapter_held
