"""An idle consumer's fetches wait longer at the broker; a busy one's as configured."""

from __future__ import annotations

from types import SimpleNamespace

from plumbing.fetch_pacing import IDLE_AFTER_S, IDLE_FETCH_WAIT_MS, FetchPacer, fetch_wait_ms


def test_the_configured_wait_holds_until_the_consumer_has_been_idle_a_while() -> None:
    assert fetch_wait_ms(5, 0.0) == 5
    assert fetch_wait_ms(5, IDLE_AFTER_S - 0.01) == 5
    assert fetch_wait_ms(5, IDLE_AFTER_S) == IDLE_FETCH_WAIT_MS
    assert fetch_wait_ms(500, 60.0) == 500, "a wait already longer is never shortened"


def test_the_pacer_sets_the_fetchers_wait_and_a_record_brings_it_back() -> None:
    fetcher = SimpleNamespace(_fetch_max_wait_ms=5)
    pacer = FetchPacer(SimpleNamespace(_fetcher=fetcher), 5, now=100.0)
    pacer.observe(0, now=101.0)
    assert fetcher._fetch_max_wait_ms == 5
    pacer.observe(0, now=100.0 + IDLE_AFTER_S)
    assert fetcher._fetch_max_wait_ms == IDLE_FETCH_WAIT_MS
    pacer.observe(3, now=110.0)
    assert fetcher._fetch_max_wait_ms == 5
    pacer.observe(0, now=110.0 + IDLE_AFTER_S / 2)
    assert fetcher._fetch_max_wait_ms == 5, "idle time counts from the last record"


def test_a_consumer_without_that_fetcher_keeps_its_wait() -> None:
    pacer = FetchPacer(SimpleNamespace(), 5, now=0.0)
    pacer.observe(0, now=60.0)
    assert pacer.wait_ms == IDLE_FETCH_WAIT_MS  # decided, with nothing to set


def test_aiokafkas_fetcher_reads_that_wait_for_every_fetch_request() -> None:
    """The attribute the pacer sets is the one aiokafka's fetcher builds each fetch request from."""
    import inspect

    from aiokafka.consumer import fetcher

    source = inspect.getsource(fetcher.Fetcher._get_actions_per_node)
    assert "FetchRequest(\n                self._fetch_max_wait_ms," in source
