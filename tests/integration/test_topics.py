"""`sluice topics create` against the real broker: the pool file's topics, kept on a second run."""

from __future__ import annotations

import pytest

from infra.topics import create_topics
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(60)


async def test_topics_are_created_once_and_kept_on_a_second_run(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    expected = [
        *(names.requests_topic(p.name) for p in settings.load_pools().pools),
        *(names.batch_topic(p.name) for p in settings.load_pools().pools),
        names.results_topic("acme"),
        names.deadletter_topic(),
        names.usage_topic(),
        names.batch_api_answers_topic(),
    ]
    first = await create_topics(settings, replication=1, teams=["acme"])
    assert [name for name, _ in first] == expected
    assert all(created for _, created in first)
    second = await create_topics(settings, replication=1, teams=["acme"])
    assert second == [(name, False) for name in expected]
