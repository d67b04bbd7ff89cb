"""Every Lua script declares its keys, and they hash to one slot, so each runs on a Redis Cluster."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from redis.crc import key_slot

from plumbing.protocol.batches import (
    COLLECT_SCRIPT,
    GIVE_SCRIPT,
    RESPONSE_SCRIPT,
    TAKE_SCRIPT,
    TRANSITION_SCRIPT,
    collect_keys,
    responses_keys,
    storage_keys,
    transition_keys,
)
from plumbing.protocol.leases import LEASE_SCRIPT, MEMBERS_SCRIPT
from plumbing.protocol.quota import RESERVE_SCRIPT, SETTLE_SCRIPT, reserve_keys, settle_keys
from plumbing.protocol.request import (
    BEGIN_SCRIPT,
    CANCEL_SCRIPT,
    CONTROL_CHUNK_SCRIPT,
    END_SCRIPT,
    PLACE_SCRIPT,
    begin_keys,
    cancel_keys,
    chunk_commands,
    control_chunk_args,
    end_args,
    place_keys,
)
from plumbing.protocol.teams import CLAIM_SCRIPT, claim_keys
from queue_schemas.messages import TokenChunk
from queue_schemas.names import Names

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "ingress",
    "dispatcher",
    "gpu_workers",
    "scaler",
    "queue_schemas",
    "plumbing",
    "openai_api",
    "infra",
)
NAMES = Names("sluice")
IDS = ("req-0001", "a1b2c3d4e5f6a7b8c9d0", "team-alpha", "chat-pool-1", "pool_odd_1")


def slots(keys: list[str]) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


def script_keys(rid: str) -> dict[str, list[str]]:
    """The KEYS each script is called with, built by the same functions the services call."""
    chunk = TokenChunk(request_id=rid, seq=0, text="a", num_tokens=1, token_ids=(1,))
    return {
        "CONTROL_CHUNK_SCRIPT": control_chunk_args(NAMES, chunk, b"", 1000, "SPUBLISH")[0],
        "END_SCRIPT": end_args(NAMES, chunk, b"", 1, 1000, "SPUBLISH")[0],
        "BEGIN_SCRIPT": begin_keys(NAMES, rid),
        "PLACE_SCRIPT": place_keys(NAMES, rid),
        "RESERVE_SCRIPT": reserve_keys(NAMES, rid, "req-9", 1.7e9),
        "SETTLE_SCRIPT": settle_keys(NAMES, rid, "req-9", 1.7e9),
        "MEMBERS_SCRIPT": [NAMES.dispatchers(rid)],
        "COLLECT_SCRIPT": collect_keys(NAMES, rid, "batch_0f"),
        "TRANSITION_SCRIPT": transition_keys(NAMES, rid, "batch_0f"),
        "CANCEL_SCRIPT": cancel_keys(NAMES, rid),
        "TAKE_SCRIPT": storage_keys(NAMES, rid),
        "GIVE_SCRIPT": storage_keys(NAMES, rid),
        "RESPONSE_SCRIPT": responses_keys(NAMES, rid),
        "CLAIM_SCRIPT": claim_keys(NAMES),
        "LEASE_SCRIPT": [
            NAMES.partition_lease(rid).format(topic=t, partition=p)
            for t in (NAMES.requests_topic(rid), NAMES.batch_topic(rid))
            for p in range(4)
        ],
    }


@pytest.mark.parametrize("ident", IDS)
def test_every_scripts_keys_share_one_slot(ident: str) -> None:
    for name, keys in script_keys(ident).items():
        assert keys, name
        assert len(slots(keys)) == 1, f"{name} touches keys in several slots: {keys}"


@pytest.mark.parametrize("ident", IDS)
def test_a_workers_chunk_commands_share_its_requests_slot(ident: str) -> None:
    """A worker's chunk is a pipeline of plain commands, not a script: still one slot, one node."""
    chunk = TokenChunk(request_id=ident, seq=3, text="a", num_tokens=1, token_ids=(1,))
    for epoch in (0, 2):
        commands = chunk_commands(NAMES, chunk, b"x", epoch, 1000, "SPUBLISH")
        keys = [str(command[1]) for command in commands]
        assert len(keys) == 4, commands
        assert slots(keys) == slots([NAMES.replay(ident)]), commands


def test_every_script_in_the_code_is_checked_here() -> None:
    """Scripts live only in plumbing.protocol (tests/unit/test_layout.py); each one is checked here."""
    found = set()
    for path in (ROOT / "plumbing" / "protocol").glob("*.py"):
        module = importlib.import_module(f"plumbing.protocol.{path.stem}")
        found |= {
            name for name, value in vars(module).items() if isinstance(value, str) and "redis.call(" in value
        }
    assert found == set(script_keys("req-0001"))


SCRIPTS = [
    CONTROL_CHUNK_SCRIPT, END_SCRIPT, BEGIN_SCRIPT, PLACE_SCRIPT, RESERVE_SCRIPT, SETTLE_SCRIPT,
    MEMBERS_SCRIPT, LEASE_SCRIPT, COLLECT_SCRIPT, TRANSITION_SCRIPT, CANCEL_SCRIPT, TAKE_SCRIPT,
    GIVE_SCRIPT, RESPONSE_SCRIPT,
    CLAIM_SCRIPT,
]  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_touch_only_declared_keys(script: str) -> None:
    """A key is never built or read from a value inside a script: each command's key is KEYS[i] or a
    loop variable over KEYS."""
    for match in re.finditer(r"redis\.call\(\s*([^,)]+)\s*,\s*([^,)]+)", script):
        command, key = match.group(1).strip(), match.group(2).strip()
        if command in ("'TIME'",):
            continue
        assert key.startswith("KEYS[") or key in ("key", "day"), f"{command} on {key}"


def test_what_belongs_to_one_thing_shares_its_slot() -> None:
    rid, worker, team, pool = "r-1", "w-1", "team-a", "chat"
    request = [
        NAMES.placement(rid), NAMES.cancelled(rid), NAMES.replay(rid), NAMES.started(rid),
        NAMES.answered(rid), NAMES.stream_channel(rid),
    ]  # fmt: skip
    per_worker = [
        NAMES.inbox(worker), NAMES.heartbeat(pool, worker), NAMES.kv_index(worker),
        NAMES.kv_snapshot(worker), NAMES.recovery_lock(worker), NAMES.left_by(worker),
        NAMES.drain_request(worker),
    ]  # fmt: skip
    per_team = [
        NAMES.team(team), NAMES.signing_keys(team), NAMES.quota_tokens(team), NAMES.quota_requests(team),
        NAMES.quota_day(team, "20261201"), NAMES.reservation(team, rid),
    ]  # fmt: skip
    per_pool = [
        NAMES.held(pool, "d1"), NAMES.dispatchers(pool), NAMES.migrations(pool), NAMES.highwater(pool),
        NAMES.batch_highwater(pool), NAMES.pool_state(pool), NAMES.workers(pool),
    ]  # fmt: skip
    for group in (request, per_worker, per_team, per_pool):
        assert len(slots(group)) == 1, group
    many = {key_slot(NAMES.stream_channel(f"r-{n}").encode()) for n in range(1000)}
    assert len(many) > 900, "streams of different requests spread over the slots"


def test_no_key_is_named_outside_names() -> None:
    """Redis key and channel names are built only in queue_schemas.names."""
    literal = re.compile(r"""f["']\{[^}]*prefix\}:""")
    offenders = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "names.py" and literal.search(path.read_text())
    ]
    assert offenders == []
