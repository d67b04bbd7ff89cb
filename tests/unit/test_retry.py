"""The one backoff every retry loop takes its delays from, and the retry through a bus outage."""

from __future__ import annotations

from itertools import islice, repeat

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from plumbing.retry import doubling, through_outage


def test_delays_double_up_to_their_cap() -> None:
    assert list(islice(doubling(0.05, 1.0), 7)) == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert list(islice(doubling(2.0, 1.0), 2)) == [2.0, 1.0]  # a first delay over the cap is tried once


async def test_a_bus_failure_is_tried_again_until_it_passes() -> None:
    failures = [RedisConnectionError("down"), OSError("reset")]
    heard: list[str] = []

    async def action() -> str:
        if failures:
            raise failures.pop(0)
        return "settled"

    assert await through_outage(action, 5.0, lambda exc: heard.append(str(exc)), repeat(0.0)) == "settled"
    assert heard == ["down", "reset"]


async def test_past_the_outage_the_last_failure_is_raised() -> None:
    tries = 0

    async def action() -> None:
        nonlocal tries
        tries += 1
        raise RedisConnectionError(f"down {tries}")

    with pytest.raises(RedisConnectionError) as raised:
        await through_outage(action, 0.3, lambda exc: None, repeat(0.05))
    assert str(raised.value) == f"down {tries}", "the last try's failure"
    assert 2 <= tries <= 7  # tried again within the window (at most 0.3 / 0.05 + 1 tries), then given up


async def test_an_error_of_another_kind_is_not_tried_again() -> None:
    tries = 0

    async def action() -> None:
        nonlocal tries
        tries += 1
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await through_outage(action, 5.0, lambda exc: None, repeat(0.0))
    assert tries == 1
