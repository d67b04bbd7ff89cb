"""Fixtures shared by every tier: the real broker and Redis-compatible server, started on free ports."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from hypothesis import settings as hypothesis_settings

from infra.launcher import free_port, start_broker, start_redis
from queue_schemas.codec import decode
from queue_schemas.messages import DeadLetter
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings

# Every property test draws the same examples on every run (a seed from the test function, no example
# database): a failure reproduces, and a pass means the same as the last one. Each test states its count.
hypothesis_settings.register_profile("sluice", derandomize=True, database=None)
hypothesis_settings.load_profile("sluice")

TIERS = (
    "unit",
    "integration",
    "e2e",
    "engine",
    "chaos",
    "cluster",
)  # the folders under tests/, one marker each
ENGINE_SCOPE, E2E_SCOPE, STACKS_SCOPE = "engines", "e2e", "stacks"  # units of work beside one per module
# The tests that start real vLLM (marked `vllm`; collection checks that each is under one of these).
ENGINE_PATHS = (
    "tests/engine/",
    "tests/e2e/smollm2/",
    "tests/e2e/test_lora.py",
    "tests/e2e/test_dev_command.py",
)


def work_scope(nodeid: str) -> str:
    """The unit of work a test belongs to under pytest-xdist: every test that starts vLLM in one (one
    process runs them all, so two vLLM stacks never run at once and a module's or package's stack
    starts once), the rest of the e2e tier in another (they share the package's embedded stack), the
    chaos and cluster tiers in a third (each module starts whole stacks of its own: one at a time), and
    any other test with the rest of its module."""
    if nodeid.startswith(ENGINE_PATHS):
        return ENGINE_SCOPE
    if nodeid.startswith("tests/e2e/"):
        return E2E_SCOPE
    if nodeid.startswith(("tests/chaos/", "tests/cluster/")):
        return STACKS_SCOPE
    return nodeid.split("::", 1)[0]


def scope_rank(scope: str) -> int:
    """The order units are handed out in: the vLLM tests first (the longest, mostly one core loading
    engines), then the unit tier (the fastest signal), then the e2e tier (the next longest), then the
    rest; units of one rank go in pytest-xdist's order, those with more tests first. Each process takes
    the next unit as its own run out, so the processes finish close together."""
    if scope == ENGINE_SCOPE:
        return 0
    if scope.startswith("tests/unit/"):
        return 1
    return 2 if scope == E2E_SCOPE else 3


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: plain pytest runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Units of work as `work_scope` draws them, handed out in `scope_rank` order, each run whole in
    one process in collection order. (pytest-xdist's own `loadgroup` marks groups by renaming test ids,
    which pytest 9.2 no longer allows.)"""
    if config.getvalue("dist") != "load":  # what `-n` alone means; another `--dist` is the user's choice
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):  # type: ignore[misc]  # pytest-xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            return work_scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            queued = sorted(self.workqueue.items(), key=lambda unit: scope_rank(unit[0]))  # stable
            self.workqueue.clear()
            self.workqueue.update(queued)
            super()._assign_work_unit(node)

        def remove_node(self, node: Any) -> str | None:
            """A process that died mid-test: its test counts as run (xdist reports the crash), and the
            rest of its unit goes to a new process, which would otherwise start with the same test. The
            units it finished are not handed out again."""
            workload = self.assigned_work.get(node, {})
            for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
                del workload[scope]
            for unit in workload.values():
                pending = [nodeid for nodeid, done in unit.items() if not done]
                if pending:
                    crashed: str = pending[0]
                    unit[crashed] = True
                    super().remove_node(node)
                    return crashed
            result: str | None = super().remove_node(node)
            return result

    return Units(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test carries the marker of its tier, the folder it lives in: `pytest -m unit` and so on.
    The tiers run in the order of `TIERS`, the fastest signal first; within a tier, in collection order.

    Under pytest-xdist (`make test` runs three processes), each unit of work (`work_scope`) runs in this
    order within its process, and the units are handed out as `pytest_xdist_make_scheduler` says."""
    root = Path(__file__).parent
    tiers: dict[str, int] = {}
    for item in items:
        tier = item.path.relative_to(root).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of the tier folders {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))
        if "vllm" in item.keywords and work_scope(item.nodeid) != ENGINE_SCOPE:
            raise pytest.UsageError(f"{item.nodeid} starts vLLM: add its path to ENGINE_PATHS")
        tiers[item.nodeid] = TIERS.index(tier)
    items.sort(key=lambda item: tiers[item.nodeid])  # stable: collection order within a tier
    _own_stacks_first(items)


def _own_stacks_first(items: list[pytest.Item]) -> None:
    """Within the e2e tier, the modules that start their own stack run before the first test of the
    shared one (`dev_stack`, which lives until the tier's last test): two stacks at once on two cores
    starve each other's engines."""
    e2e = [n for n, item in enumerate(items) if "e2e" in item.keywords]
    shared = [n for n in e2e if "dev_stack" in getattr(items[n], "fixturenames", ())]
    ordered = [items[n] for n in e2e if n not in shared] + [items[n] for n in shared]
    for n, item in zip(e2e, ordered, strict=True):
        items[n] = item


# Short group timings: the dev broker joins a group in half the session timeout.
FAST_KAFKA = {
    "kafka_fetch_wait_ms": 5,
    "kafka_session_timeout_ms": 3000,
    "kafka_heartbeat_interval_ms": 500,
}


@dataclass(frozen=True)
class Bus:
    kafka_bootstrap: str
    redis_url: str

    def settings(self, cls: type[BusSettings] = BusSettings, **overrides: object) -> BusSettings:
        """Settings under a fresh prefix, so tests sharing the bus never see each other's names."""
        fields: dict[str, object] = {
            "kafka_bootstrap": self.kafka_bootstrap,
            "redis_url": self.redis_url,
            "prefix": f"t{secrets.token_hex(4)}",
            **FAST_KAFKA,
        }
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    log_dir: Path = tmp_path_factory.mktemp("bus")
    kafka_port, redis_port = free_port(), free_port()
    broker = start_broker(kafka_port, log_dir)
    redis = start_redis(redis_port, log_dir)
    try:
        yield Bus(f"127.0.0.1:{kafka_port}", f"redis://127.0.0.1:{redis_port}/0")
    finally:
        redis.stop()
        broker.stop()


async def read_dead_letters(
    kafka_bootstrap: str,
    names: Names,
    at_least: int = 0,
    wanted: Callable[[DeadLetter], bool] = lambda _: True,
    within_s: float = 30.0,
) -> list[DeadLetter]:
    """The letters on the dead-letter topic that `wanted` keeps: all of them up to the topic's end when
    called, and with `at_least`, read on until that many are kept, then to the end the topic has then.
    Whatever was read by `within_s` if that comes first (the caller's assertion says what is missing)."""
    consumer = AIOKafkaConsumer(
        names.deadletter_topic(),
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=5,
    )
    await consumer.start()
    letters: list[DeadLetter] = []
    try:
        async with asyncio.timeout(within_s):
            ends = await consumer.end_offsets(list(consumer.assignment()))
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                found = [decode(DeadLetter, r.value) for records in batch.values() for r in records]
                letters += [letter for letter in found if wanted(letter)]
                if len(letters) < at_least or not await read_to(consumer, ends):
                    continue
                later = await consumer.end_offsets(list(ends))
                if later == ends:
                    return letters
                ends = later  # written while this read: a late duplicate would be among them
    except TimeoutError:
        return letters
    finally:
        await consumer.stop()


async def read_to(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """Whether the consumer has read every partition up to `ends`."""
    return all([await consumer.position(tp) >= end for tp, end in ends.items()])
