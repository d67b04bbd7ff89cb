"""Which class runs each engine (queue_schemas.engines says what each can do). Adding an engine is a name
in queue_schemas.engines, its capabilities there, and one entry here."""

from __future__ import annotations

from collections.abc import Callable

from gpu_workers.engine import Engine
from gpu_workers.settings import WorkerSettings
from plumbing.model_store import ModelStore
from queue_schemas.config import PoolConfig


def _simulated(pool: PoolConfig, settings: WorkerSettings) -> Engine:
    from gpu_workers.simulated import SimulatedEngine

    config = pool.simulated.model_copy(update={"max_running": pool.engine_slots})
    return SimulatedEngine(config, pool.block_size, pool.max_loras)


def _vllm(pool: PoolConfig, settings: WorkerSettings) -> Engine:
    from gpu_workers.vllm_engine import VllmEngine  # imports vLLM only where it runs

    return VllmEngine(pool, ModelStore(settings.model_cache_dir), settings.spec_decoding, settings.role)


BUILDERS: dict[str, Callable[[PoolConfig, WorkerSettings], Engine]] = {
    "simulated": _simulated,
    "vllm": _vllm,
}


def build_engine(pool: PoolConfig, settings: WorkerSettings) -> Engine:
    return BUILDERS[pool.engine](pool, settings)
