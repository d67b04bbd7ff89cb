"""Which dispatcher consumes which partition: short leases in Redis instead of the Kafka group protocol.

A Kafka consumer group notices a dead member only after its session timeout, then stops every member
for a rebalance (on the dev broker a join alone takes half the session timeout): a killed dispatcher
stalled its pool for about eight seconds. Here each partition of the pool's two topics has a lease in
Redis, held by one dispatcher and renewed every `lease_ms / 4`; it lapses `lease_ms` after its holder
stops. Every dispatcher of the pool (two by default, both active) keeps a fair share of the partitions
and claims a lapsed lease at its next round, assigns itself the partition (`consumer.assign`) and
resumes at the committed offset. A dead dispatcher's partitions pause for about `lease_ms` plus a round;
the others' do not pause at all.

Offsets are still committed to the pool's consumer group, as a group without members (an OffsetCommit
with generation -1, which Apache Kafka accepts for a group in the Empty state, and the dev broker
too), so lag, the scaler and dashboards read them as before. A holder that cannot renew in time stops
consuming the partition before its lease can lapse; placement is idempotent by request id, so the rare
overlap of two holders (one stalled past its lease) places nothing twice.

`plan` is the pure decision; `Leases` does the Redis round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from plumbing.protocol.leases import LEASE_SCRIPT, MEMBERS_SCRIPT

log = structlog.get_logger("sluice.dispatcher.leases")

Partition = tuple[str, int]
PARTITIONS_REFRESH_S = 10.0  # how often the topics' partition lists are read again


@dataclass(frozen=True, slots=True)
class LeasePlan:
    claim: tuple[Partition, ...]  # held by nobody alive: this dispatcher takes them
    over_share: tuple[Partition, ...]  # held beyond its share: handed back once their work is committed


def fair_share(me: str, live: Sequence[str], partitions: int) -> int:
    """How many of `partitions` this dispatcher should hold: an even split, the remainder going to the
    first members in id order, so the shares add up to the partition count."""
    members = sorted({*live, me})
    base, extra = divmod(partitions, len(members))
    return base + (1 if members.index(me) < extra else 0)


def plan(
    partitions: Sequence[Partition], owners: dict[Partition, str | None], me: str, live: Sequence[str]
) -> LeasePlan:
    """Per topic: claim partitions nobody alive holds until this dispatcher has its share, and mark
    what it holds beyond the share. A partition whose holder is gone is free at once; one whose lease
    lapsed has no holder."""
    claim: list[Partition] = []
    over: list[Partition] = []
    alive = sorted({*live, me})
    for topic in sorted({t for t, _ in partitions}):
        ours = sorted(p for p in partitions if p[0] == topic)
        share = fair_share(me, alive, len(ours))
        held = [p for p in ours if owners.get(p) == me]
        over += held[share:]
        free = [p for p in ours if owners.get(p) not in alive]
        claim += free[: max(0, share - len(held))]
    return LeasePlan(tuple(claim), tuple(over))


@dataclass(frozen=True, slots=True)
class Ownership:
    held: frozenset[Partition]  # leased to this dispatcher after the round
    over_share: frozenset[Partition]  # of those, the ones to hand back


class Leases:
    """The Redis side of partition ownership for one dispatcher."""

    def __init__(
        self, redis: aioredis.Redis, members_key: str, lease_key: str, me: str, lease_ms: int
    ) -> None:
        self._redis = redis
        self._members_key = members_key
        self._lease_key = lease_key  # a format string with {topic} and {partition}
        self.me = me
        self.lease_ms = lease_ms
        self._members = redis.register_script(MEMBERS_SCRIPT)
        self._leases = redis.register_script(LEASE_SCRIPT)

    def key(self, partition: Partition) -> str:
        return self._lease_key.format(topic=partition[0], partition=partition[1])

    async def round(self, partitions: Sequence[Partition], releasing: set[Partition]) -> Ownership:
        """Renew what this dispatcher holds, claim its share of what is free, and give up `releasing`
        (partitions it has stopped consuming, their finished work committed)."""
        members = await self._members(keys=[self._members_key], args=[self.me, self.lease_ms])
        live = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        raw = await self._redis.mget([self.key(p) for p in partitions]) if partitions else []
        owners = {p: o.decode() if isinstance(o, bytes) else o for p, o in zip(partitions, raw, strict=True)}
        decided = plan(partitions, owners, self.me, live)
        # Its own leases are claimed again, not only renewed: one that lapsed since the read (a stalled
        # loop) and that nobody took stays with this dispatcher, its consumer's place and holds intact.
        actions = [(p, "claim") for p in partitions if owners[p] == self.me and p not in releasing]
        actions += [(p, "claim") for p in decided.claim if p not in releasing]
        actions += [(p, "release") for p in releasing]
        if not actions:
            return Ownership(frozenset(), frozenset())
        kept = await self._leases(
            keys=[self.key(p) for p, _ in actions], args=[self.me, self.lease_ms, *(a for _, a in actions)]
        )
        held = frozenset(p for (p, _), k in zip(actions, kept, strict=True) if int(k))
        return Ownership(held, frozenset(decided.over_share) & held)


class LeasedPartitions:
    """The partitions a dispatcher consumes, kept in step with its leases.

    `keep` runs beside the dispatcher's loop and works out the target set every quarter lease; the
    loop calls `to_drop` and `follow` between fetches, so the consumer's assignment changes only there.
    """

    def __init__(self, consumer: AIOKafkaConsumer, leases: Leases, topics: Sequence[str]) -> None:
        self._consumer = consumer
        self._leases = leases
        self._topics = tuple(topics)
        self._target: frozenset[Partition] = frozenset()
        self._releasing: set[Partition] = set()  # no longer consumed; the next round gives them up

    def owned(self) -> set[Partition]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def to_drop(self) -> set[Partition]:
        """Partitions consumed now that the leases no longer give this dispatcher."""
        return self.owned() - self._target

    def follow(self, dropped: set[Partition], paused_topics: set[str]) -> None:
        """Assign the consumer the target set (`dropped` were committed and forgotten by the caller);
        partitions of paused topics stay paused."""
        target = self._target
        if target == self.owned():
            return
        self._releasing |= dropped
        self._consumer.assign([TopicPartition(*p) for p in sorted(target)])
        paused = [TopicPartition(*p) for p in target if p[0] in paused_topics]
        if paused:
            self._consumer.pause(*paused)
        log.info("partitions", consuming=sorted(f"{t}:{p}" for t, p in target), gave_up=len(dropped))

    async def keep(self, stop: asyncio.Event) -> None:
        """Keep the leases: renewed, a fair share claimed, extras handed back once dropped. If renewals
        keep failing, consume nothing before the leases can lapse and pass to another dispatcher."""
        period = self._leases.lease_ms / 4000
        partitions: list[Partition] = []
        last_ok = listed_at = time.monotonic()
        while not stop.is_set():
            try:
                if not partitions or time.monotonic() - listed_at > PARTITIONS_REFRESH_S:
                    partitions, listed_at = await self._list(), time.monotonic()
                releasing = set(self._releasing)
                ownership = await self._leases.round(partitions, releasing)
                self._releasing -= releasing
                self._target = ownership.held - ownership.over_share - self._releasing
                last_ok = time.monotonic()
            except (RedisError, KafkaError, OSError) as exc:
                if time.monotonic() - last_ok > 2 * period:
                    log.warning("partition leases not renewed; pausing consumption", error=str(exc))
                    self._target = frozenset()
            await asyncio.sleep(period)

    async def hand_back(self) -> None:
        """Give up every lease now (a stopping dispatcher), rather than when they lapse."""
        with contextlib.suppress(RedisError):
            await self._leases.round([], self.owned() | self._releasing)

    async def _list(self) -> list[Partition]:
        await self._consumer.topics()  # refreshes the metadata
        found: list[Partition] = []
        for topic in self._topics:
            found += [(topic, p) for p in sorted(self._consumer.partitions_for_topic(topic) or ())]
        return found
