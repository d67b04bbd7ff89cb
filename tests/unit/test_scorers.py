"""Placement scorers are plugins: each is registered once, the settings name them, and a scorer added in
one module takes part in both the reference and the columnar placement."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
from pydantic import ValidationError

from dispatcher import scorers
from dispatcher.placement import Demand, PlacementPolicy, WorkerSnapshot, choose
from dispatcher.scorers import SCORERS, Candidates, Floats, default_weights, register
from dispatcher.settings import DispatcherSettings
from dispatcher.table import choose_over
from queue_schemas.messages import Heartbeat, WorkerState

NOW = 1000.0


def snapshot(worker_id: str, waiting: int) -> WorkerSnapshot:
    hb = Heartbeat(
        worker_id=worker_id, pool="p", model="m", state=WorkerState.READY, seq=1, sent_at=NOW, ttl_ms=3000,
        kv_blocks_total=1000, kv_blocks_free=900, block_size=16, running=0, waiting=waiting,
        inbox_pending=0, decode_tokens_per_s=0.0, started_at=0.0, max_running=64,
    )  # fmt: skip
    return WorkerSnapshot(hb)


def test_the_four_scorers_are_registered_with_their_defaults() -> None:
    assert default_weights() == {"prefix": 5.0, "kv": 2.0, "queue": 2.0, "adapter": 3.0}
    assert PlacementPolicy().weights == default_weights()


@pytest.fixture
def named_scorer() -> Iterator[str]:
    """A scorer that prefers a worker with 7 queued, registered in one line as any other."""

    @register("last-name", 0.0)
    def last_name(candidates: Candidates) -> Floats:
        return np.array([1.0 if q == 7.0 else 0.0 for q in candidates.queue])

    try:
        yield "last-name"
    finally:
        del SCORERS["last-name"]
        del scorers.DEFAULT_WEIGHTS["last-name"]


def test_a_new_scorer_takes_part_in_both_paths_once_weighted(named_scorer: str) -> None:
    workers = [snapshot("w-a", 0), snapshot("w-b", 3), snapshot("w-last", 7)]
    demand = Demand(32, ("h1", "h2"), 16)
    plain = PlacementPolicy(objective="score")
    weighted = PlacementPolicy(weights={**default_weights(), named_scorer: 10.0}, objective="score")
    for pick in (choose, choose_over):
        assert pick(workers, demand, NOW, plain, random.Random(0)).worker_id == "w-a"  # the shortest queue
        assert pick(workers, demand, NOW, weighted, random.Random(0)).worker_id == "w-last"
    settings = DispatcherSettings(pool="p", scorer_weights={named_scorer: 10.0})
    assert settings.policy().weights[named_scorer] == 10.0


def test_the_settings_refuse_a_scorer_that_is_not_registered() -> None:
    with pytest.raises(ValidationError, match="no scorer is named 'recency'"):
        DispatcherSettings(pool="p", scorer_weights={"recency": 1.0})
    with pytest.raises(ValidationError, match="negative"):
        DispatcherSettings(pool="p", scorer_weights={"kv": -1.0})
    partial = DispatcherSettings(pool="p", scorer_weights={"adapter": 0.0}).policy().weights
    assert partial == {**default_weights(), "adapter": 0.0}


def test_a_weight_set_by_its_retired_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_PREFIX_WEIGHT", "3")
    with pytest.raises(ValidationError, match="SLUICE_SCORER_WEIGHTS"):
        DispatcherSettings(pool="p")


def test_a_policy_naming_no_scorer_is_refused() -> None:
    with pytest.raises(ValueError, match="no scorer is named 'recency'"):
        PlacementPolicy(weights={"recency": 1.0})
