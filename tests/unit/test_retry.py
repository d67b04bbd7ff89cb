"""The one backoff every retry loop takes its delays from."""

from __future__ import annotations

from itertools import islice

from plumbing.retry import doubling


def test_delays_double_up_to_their_cap() -> None:
    assert list(islice(doubling(0.05, 1.0), 7)) == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert list(islice(doubling(2.0, 1.0), 2)) == [2.0, 1.0]  # a first delay over the cap is tried once
