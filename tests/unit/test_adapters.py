from __future__ import annotations

import pytest

from gpu_workers.adapters import AdapterLru, Use


def test_an_adapter_is_loaded_once_and_the_least_recently_used_is_evicted() -> None:
    lru = AdapterLru(capacity=2)
    assert lru.use("a") == Use(loaded=True)
    assert lru.use("b") == Use(loaded=True)
    assert lru.use("a") == Use(loaded=False)  # held: no load, and now the most recent
    assert lru.use("c") == Use(loaded=True, evicted="b")
    assert lru.held() == ("a", "c")
    assert "b" not in lru
    assert lru.use("b") == Use(loaded=True, evicted="a")


def test_an_adapter_cache_holds_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least one"):
        AdapterLru(0)
