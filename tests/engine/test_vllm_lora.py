"""LoRA adapters on real vLLM (CPU): adapters the test makes itself (random weights in PEFT's layout) on
the tiny Llama, loaded on demand by one engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from gpu_workers.engine import RequestFailed
from gpu_workers.vllm_engine import VllmEngine
from infra.models import build_lora_adapter
from plumbing.model_store import ModelStore
from queue_schemas.config import AdapterConfig
from queue_schemas.messages import InferenceRequest
from tests.engine.conftest import ENGINE_TIMEOUT, request_for, tiny_pool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(ENGINE_TIMEOUT), pytest.mark.asyncio(loop_scope="module")]

PROMPT = [(i * 7) % 250 + 5 for i in range(24)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    folder = tmp_path_factory.mktemp("adapters")
    adapters = tuple(
        AdapterConfig(name=f"tiny-{name}", source=str(build_lora_adapter(folder / name, tiny_llama, seed)))
        for seed, name in enumerate(("sql", "poem"), 1)
    )
    pool = tiny_pool(str(tiny_llama), adapters=adapters, max_loras=2)
    e = VllmEngine(pool, ModelStore(tmp_path_factory.mktemp("cache")), spec_decoding=False)
    await e.start()
    yield e
    await e.close()


async def greedy(engine: VllmEngine, adapter: str | None, rid: str) -> tuple[int, ...]:
    request: InferenceRequest = request_for(PROMPT, 12, rid=rid).model_copy(update={"adapter": adapter})
    tokens: list[int] = []
    async for out in engine.generate(request):
        tokens.extend(out.token_ids)
    return tuple(tokens)


async def test_two_adapters_on_one_engine_answer_as_each_does_alone(engine: VllmEngine) -> None:
    base = await greedy(engine, None, "lora-base-000000001")
    sql = await greedy(engine, "tiny-sql", "lora-sql-0000000001")
    poem = await greedy(engine, "tiny-poem", "lora-poem-000000001")
    assert len({base, sql, poem}) == 3, "each adapter changes the greedy answer, differently"
    # The same three at once, in one batch: each answer equals its run alone.
    together = await asyncio.gather(
        greedy(engine, "tiny-poem", "lora-poem-000000002"),
        greedy(engine, None, "lora-base-000000002"),
        greedy(engine, "tiny-sql", "lora-sql-0000000002"),
    )
    assert list(together) == [poem, base, sql]
    assert set(engine.stats().adapters) == {"tiny-sql", "tiny-poem"}


async def test_an_adapter_the_pool_does_not_declare_is_refused(engine: VllmEngine) -> None:
    with pytest.raises(RequestFailed, match="no adapter named"):
        await greedy(engine, "tiny-unknown", "lora-unknown-000001")
