"""Prefill on one vLLM engine, decode on another, through the pool's KV connector (vLLM's shared-storage
ExampleConnector on CPU): the decode engine loads the prompt's KV instead of computing it, and its greedy
output equals an engine's that did both."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_workers.engine import EngineOutput
from gpu_workers.vllm_engine import VllmEngine
from queue_schemas.config import KvConnectorConfig, VllmEngineConfig
from queue_schemas.messages import KvRole
from queue_schemas.model_store import ModelStore
from tests.engine.conftest import BLOCK, ENGINE_TIMEOUT, request_for, tiny_pool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(ENGINE_TIMEOUT)]

PROMPT = [(i * 11) % 397 + 5 for i in range(300)]  # two full blocks of 128 and a partial one


async def run(
    tiny_llama: Path, cache: Path, prompt: list[int], max_tokens: int, rid: str,
    storage: Path | None = None, role: KvRole = "both",
) -> list[EngineOutput]:  # fmt: skip
    """One engine, started for this run, with the shared-storage connector when `storage` is given."""
    connector = None if storage is None else KvConnectorConfig(extra={"shared_storage_path": str(storage)})
    config = VllmEngineConfig(
        source=str(tiny_llama), kv_cache_gib=0.25, max_num_seqs=8, kv_connector=connector
    )
    engine = VllmEngine(tiny_pool(str(tiny_llama), vllm=config), ModelStore(cache), False, role)
    await engine.start()
    try:
        return [out async for out in engine.generate(request_for(prompt, max_tokens, rid))]
    finally:
        await engine.close()


async def test_a_prompt_prefilled_on_one_engine_is_decoded_on_another_exactly(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cache, storage = tmp_path / "cache", tmp_path / "kv"
    single = await run(tiny_llama, cache, PROMPT, 24, "single-000000000001")
    assert single[-1].prompt_tokens == len(PROMPT)
    # The handoff: one token on the prefill engine, which saves the prompt's KV, one file per layer.
    prefilled = await run(tiny_llama, cache, PROMPT, 1, "prefill-00000000001", storage, "prefill")
    assert prefilled[-1].cached_tokens == 0
    saved = list(storage.rglob("*.safetensors"))
    assert saved, "the prefill engine wrote the prompt's KV"
    # The decode engine loads it: its prompt's leading blocks count as cached (the external hit), and
    # its greedy tokens are the single engine's.
    decoded = await run(tiny_llama, cache, PROMPT, 24, "decode-000000000001", storage, "decode")
    assert decoded[-1].cached_tokens == 2 * BLOCK
    assert [t for o in decoded for t in o.token_ids] == [t for o in single for t in o.token_ids]
    assert "".join(o.text for o in decoded) == "".join(o.text for o in single)
