"""The topics a deployment needs, from its pool file: created once by `sluice topics create`."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from plumbing.clients import admin_options
from queue_schemas.config import SluiceConfig
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings

RESULTS_PARTITIONS = 4


def pool_topics(config: SluiceConfig, names: Names, replication: int, teams: list[str]) -> list[NewTopic]:
    """Requests and batch topics per pool (partitions from the pool), the dead-letter topic, the usage
    topic, the answers topic of /v1/batches, and a results topic per named team."""
    topics = [NewTopic(names.requests_topic(p.name), p.partitions, replication) for p in config.pools]
    topics += [NewTopic(names.batch_topic(p.name), p.partitions, replication) for p in config.pools]
    topics += [NewTopic(names.results_topic(team), RESULTS_PARTITIONS, replication) for team in teams]
    topics.append(NewTopic(names.deadletter_topic(), 1, replication))
    topics.append(NewTopic(names.usage_topic(), RESULTS_PARTITIONS, replication))
    topics.append(NewTopic(names.batch_api_answers_topic(), RESULTS_PARTITIONS, replication))
    return topics


async def create_topics(settings: BusSettings, replication: int, teams: list[str]) -> list[tuple[str, bool]]:
    """Create each topic the pools need that does not exist yet; return (name, created) for each."""
    return await create_missing(
        settings, pool_topics(settings.load_pools(), settings.names, replication, teams)
    )


async def create_missing(settings: BusSettings, topics: list[NewTopic]) -> list[tuple[str, bool]]:
    """Create each of `topics` that does not exist yet, in one request; return (name, created) for each,
    in order. The broker answers per topic: one that exists is kept, any other refusal raises."""
    admin = AIOKafkaAdminClient(**admin_options(settings))
    await admin.start()
    try:
        response = await admin.create_topics(topics)
    finally:
        await admin.close()
    return creation_outcomes([t.name for t in topics], response.topic_errors)


def creation_outcomes(
    names: list[str], topic_errors: list[tuple[str, int, str | None]]
) -> list[tuple[str, bool]]:
    """(name, created) per topic from a CreateTopics answer; an error other than "already exists" raises
    the broker's error, naming the topic."""
    outcome = {name: (code, message) for name, code, message in topic_errors}
    out = []
    for name in names:
        code, message = outcome.get(name, (0, None))
        if code not in (0, TopicAlreadyExistsError.errno):
            raise for_code(code)(f"topic {name}: {message or 'refused'}")
        out.append((name, code == 0))
    return out
