"""Backoff between tries, written once: every retry loop in the services takes its delays from here."""

from __future__ import annotations

from collections.abc import Iterator


def doubling(first_s: float, max_s: float) -> Iterator[float]:
    """Delays between tries: `first_s`, then twice the last, at most `max_s`, for ever."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)
