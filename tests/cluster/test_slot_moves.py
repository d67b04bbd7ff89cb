"""The stream hub follows a channel whose slot is moved to another primary (resharding): the old owner
tells its subscribers with an unrequested SUNSUBSCRIBE, and the hub subscribes on the new owner and
has the stream catch up from its log."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from redis.crc import key_slot

from infra.launcher import LocalCluster, free_ports, node_command, start_redis_cluster
from ingress.streams import RESYNC, StreamHub
from plumbing.clients import as_cluster, node_client, redis_client
from queue_schemas.settings import BusSettings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    running = start_redis_cluster(free_ports(3), tmp_path)
    try:
        yield running
    finally:
        running.stop()


def owner_port(port: int, slot: int) -> int:
    """The port of the primary that serves `slot`, as `port`'s node sees it."""
    for node in node_command(port, "CLUSTER", "NODES").splitlines():
        fields = node.split()
        for part in fields[8:]:
            first, _, last = part.partition("-")
            if first.isdigit() and int(first) <= slot <= int(last or first):
                return int(fields[1].split(":")[1].split("@")[0])
    raise AssertionError(f"no owner for slot {slot}")


def move_slot(ports: list[int], slot: int, source: int, target: int) -> None:
    """Reassign `slot` from `source` to `target` (it holds no keys), and tell every node."""
    source_id = node_command(source, "CLUSTER", "MYID").strip()
    target_id = node_command(target, "CLUSTER", "MYID").strip()
    node_command(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
    node_command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
    for port in (target, source, *[p for p in ports if p not in (source, target)]):
        node_command(port, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)


async def test_a_stream_follows_its_slot_to_another_primary(cluster: LocalCluster) -> None:
    settings = BusSettings(redis_url=cluster.url, redis_cluster=True, prefix="moves")
    names = settings.names
    redis = redis_client(settings)
    hub = StreamHub(
        redis_client(settings, retry=False),
        names.ingress_control_channel(),
        node_client=partial(node_client, settings),
    )
    await hub.start()
    channel = names.stream_channel("req-slot-move-01")
    slot = key_slot(channel.encode())
    try:
        sub = await hub.subscribe(channel)
        await redis.spublish(channel, b"before")
        assert await sub.next(time.time() + 5) == b"before"
        source = owner_port(cluster.ports[0], slot)
        target = next(p for p in cluster.ports if p != source)
        move_slot(cluster.ports, slot, source, target)
        assert owner_port(target, slot) == target
        assert await sub.next(time.time() + 10) == RESYNC, "told to catch up from the log after the move"
        client = as_cluster(redis)
        assert client is not None
        await client.nodes_manager.initialize()
        delivered = await redis.spublish(channel, b"after")
        assert delivered == 1, "the hub is subscribed on the new owner"
        assert await sub.next(time.time() + 5) == b"after"
        assert hub.connected
    finally:
        await hub.close()
        await redis.aclose()
