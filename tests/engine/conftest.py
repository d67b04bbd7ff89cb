"""Real vLLM on CPU: a tiny random-weight Llama for the engine paths, SmolLM2 for real answers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.models import build_tiny_llama
from queue_schemas.config import PoolConfig, VllmEngineConfig
from queue_schemas.messages import InferenceRequest, SamplingParams
from queue_schemas.prefix import block_hashes

BLOCK = 128  # vLLM's block size on CPU
ENGINE_TIMEOUT = 600


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def _cpu_engine_environment() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiny_pool(source: str, **overrides: object) -> PoolConfig:
    # One OpenMP thread, unbound: engines here share two cores with the test and with each other.
    engine = VllmEngineConfig(source=source, kv_cache_gib=0.25, max_num_seqs=8, cpu_threads=1)
    fields: dict[str, object] = {
        "name": "tiny",
        "model": "tiny",
        "engine": "vllm",
        "block_size": BLOCK,
        "context_tokens": 2048,
        "vllm": engine,
    }
    return PoolConfig.model_validate({**fields, **overrides})


def request_for(
    tokens: list[int],
    max_tokens: int = 16,
    rid: str = "req-0000000000000001",
    salt: str | None = None,
    **sampling: object,
) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        pool="tiny",
        model="tiny",
        team="t",
        prompt_token_ids=tuple(tokens),
        block_hashes=tuple(block_hashes(tokens, BLOCK, salt=salt)),
        cache_salt=salt,
        sampling=SamplingParams.model_validate({"max_tokens": max_tokens, "temperature": 0.0, **sampling}),
        created_at=0.0,
        deadline=1e12,
    )
