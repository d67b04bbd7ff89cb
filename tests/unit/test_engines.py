"""One table says which engines exist and what each can do; one maps each to its class; engine errors say
which kind of failure they are."""

from __future__ import annotations

import typing

from gpu_workers.engine import EngineDead, EngineError, RequestFailed, StartFailed
from gpu_workers.engines import BUILDERS
from queue_schemas.config import PoolConfig, VllmEngineConfig
from queue_schemas.engines import ENGINES, EngineName


def test_every_engine_name_has_its_capabilities_and_its_class() -> None:
    names = set(typing.get_args(EngineName))
    assert set(ENGINES) == names
    assert set(BUILDERS) == names
    assert all(kind.name == name for name, kind in ENGINES.items())
    # The worker ends a request on any EngineError; each kind is one.
    assert all(issubclass(kind, EngineError) for kind in (RequestFailed, StartFailed, EngineDead))


def test_a_pools_engine_capabilities_come_from_the_table() -> None:
    sim = PoolConfig(name="sim", model="m")
    assert not sim.kind.compiles_schemas
    assert sim.tokenizer_source == "bytes"
    vllm = PoolConfig(name="v", model="m", engine="vllm", vllm=VllmEngineConfig(source="/models/m"))
    assert vllm.kind.compiles_schemas
    assert vllm.tokenizer_source == "/models/m"
