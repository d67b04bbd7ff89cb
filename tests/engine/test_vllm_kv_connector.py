"""Prefill on one vLLM engine, decode on another, through sluice's handoff connector
(gpu_workers.kv_handoff, vLLM's shared-storage connector limited to handoffs): the decode engine loads
the prompt's KV instead of computing it, and its greedy output equals an engine's that did both. On the
tiny random-weight Llama and on SmolLM2."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from gpu_workers.engine import EngineOutput
from gpu_workers.handoff import KvTransfer
from gpu_workers.prefill import expected_rows, saved_rows
from gpu_workers.vllm_engine import VllmEngine
from infra.models import prepare_smollm2
from plumbing.model_store import ModelStore
from queue_schemas.config import HANDOFF_CONNECTOR, KvConnectorConfig, VllmEngineConfig
from queue_schemas.messages import KvRole
from tests.engine.conftest import BLOCK, ENGINE_TIMEOUT, request_for, tiny_pool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(ENGINE_TIMEOUT)]

MODELS = Path(__file__).parents[2] / ".sluice" / "models"
PROMPT = [(i * 11) % 397 + 5 for i in range(300)]  # two full blocks of 128 and a partial one
OTHER = [(i * 7) % 389 + 11 for i in range(300)]


@pytest.fixture(params=["tiny-llama", "smollm2"])
def source(request: pytest.FixtureRequest, tiny_llama: Path) -> Path:
    if request.param == "tiny-llama":
        return tiny_llama
    return prepare_smollm2(MODELS / "smollm2-135m-instruct", MODELS / "downloads").resolve()


def engine(source: Path, cache: Path, storage: Path, role: KvRole) -> VllmEngine:
    connector = KvConnectorConfig(connector=HANDOFF_CONNECTOR, extra={"shared_storage_path": str(storage)})
    config = VllmEngineConfig(
        source=str(source), kv_cache_gib=0.25, max_num_seqs=8, cpu_threads=1, kv_connector=connector
    )
    return VllmEngine(tiny_pool(str(source), vllm=config), ModelStore(cache), False, role)


async def run(
    e: VllmEngine, prompt: list[int], max_tokens: int, rid: str, kv: KvTransfer | None
) -> list[EngineOutput]:
    return [out async for out in e.generate(request_for(prompt, max_tokens, rid), kv)]


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_a_prompt_prefilled_on_one_engine_is_decoded_on_another_exactly(
    source: Path, tmp_path: Path
) -> None:
    cache, storage = tmp_path / "cache", tmp_path / "kv"
    handoff = secrets.token_hex(16)
    prefill, decode = engine(source, cache, storage, "prefill"), engine(source, cache, storage, "decode")
    try:
        # Both start at once; the decode engine runs nothing until the prefill engine has saved the KV.
        started = await asyncio.gather(prefill.start(), decode.start(), return_exceptions=True)
        for failed in (s for s in started if isinstance(s, BaseException)):
            raise failed  # both starts have ended: `finally` closes whichever engine came up
        # The handoff's prefill: one token, with the prompt's KV saved under the handoff's id alone.
        prefilled = await run(prefill, PROMPT, 1, "prefill-00000000001", KvTransfer(handoff, save=True))
        assert prefilled[-1].cached_tokens == 0
        assert [p.name for p in storage.iterdir()] == [handoff]
        assert saved_rows(storage / handoff) == {expected_rows(len(PROMPT), BLOCK)}
        # A request without a handoff saves nothing: no other prompt's KV reaches the shared folder.
        await run(prefill, OTHER, 4, "plain-0000000000001", None)
        assert [p.name for p in storage.iterdir()] == [handoff]
        # The single-engine answer: this engine computed the prompt itself.
        single = await run(prefill, PROMPT, 24, "single-000000000001", None)
        # The decode engine loads it: the prompt's leading whole blocks (less its last token) count as
        # cached (the external hit: this engine never saw the prompt), and its greedy tokens are the
        # single engine's.
        decoded = await run(decode, PROMPT, 24, "decode-000000000001", KvTransfer(handoff, save=False))
        assert decoded[-1].cached_tokens == 2 * BLOCK
        assert tokens(decoded) == tokens(single)
        assert "".join(o.text for o in decoded) == "".join(o.text for o in single)
        # Another handoff id finds nothing: the prompt is computed, and the answer is the same.
        elsewhere = await run(
            decode, OTHER, 8, "other-0000000000001", KvTransfer(secrets.token_hex(16), False)
        )
        assert elsewhere[-1].cached_tokens == 0
    finally:
        await prefill.close()
        await decode.close()
