"""The topics a deployment needs, from its pool file: created once by `sluice topics create`."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from queue_schemas.clients import admin_options
from queue_schemas.config import SluiceConfig
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings


def pool_topics(config: SluiceConfig, names: Names, replication: int, teams: list[str]) -> list[NewTopic]:
    """Requests and batch topics per pool (partitions from the pool), the dead-letter topic, and a
    results topic per named team."""
    topics = [NewTopic(names.requests_topic(p.name), p.partitions, replication) for p in config.pools]
    topics += [NewTopic(names.batch_topic(p.name), p.partitions, replication) for p in config.pools]
    topics += [NewTopic(names.results_topic(team), 4, replication) for team in teams]
    topics.append(NewTopic(names.deadletter_topic(), 1, replication))
    return topics


async def create_topics(settings: BusSettings, replication: int, teams: list[str]) -> list[tuple[str, bool]]:
    """Create each topic that does not exist yet; return (name, created) for each, in order."""
    admin = AIOKafkaAdminClient(**admin_options(settings))
    await admin.start()
    out = []
    try:
        for topic in pool_topics(settings.load_pools(), settings.names, replication, teams):
            try:
                await admin.create_topics([topic])
                out.append((topic.name, True))
            except TopicAlreadyExistsError:
                out.append((topic.name, False))
    finally:
        await admin.close()
    return out
