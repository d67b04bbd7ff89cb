"""vLLM's priority scheduler as the worker drives it: interactive work ahead of batch work, and batch
requests preempted by interactive ones still finish with their whole answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from gpu_workers.vllm_engine import VllmEngine
from plumbing.model_store import ModelStore
from queue_schemas.messages import InferenceRequest, Priority
from tests.engine.conftest import ENGINE_TIMEOUT, request_for, tiny_pool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(ENGINE_TIMEOUT), pytest.mark.asyncio(loop_scope="module")]

PROMPT = [(i * 11) % 300 + 3 for i in range(40)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_slot(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    """An engine that runs one request at a time, so the order of the others is the scheduler's."""
    pool = tiny_pool(str(tiny_llama))
    one = pool.vllm.model_copy(update={"max_num_seqs": 1})  # type: ignore[union-attr]
    pool = pool.model_copy(update={"vllm": one, "light_slots": 0})
    e = VllmEngine(pool, ModelStore(tmp_path_factory.mktemp("cache")), spec_decoding=False)
    await e.start()
    yield e
    await e.close()


def batch(request: InferenceRequest) -> InferenceRequest:
    return request.model_copy(update={"priority": Priority.BATCH})


async def test_an_interactive_request_runs_ahead_of_batch_requests_queued_before_it(
    one_slot: VllmEngine,
) -> None:
    done: list[str] = []

    async def run(request: InferenceRequest) -> None:
        async for out in one_slot.generate(request):
            if out.finish_reason is not None:
                done.append(request.request_id)

    first = batch(request_for(PROMPT, 400, rid="batch-running-000001"))
    tokens: list[int] = []
    holds_the_slot = asyncio.Event()

    async def run_first() -> None:
        async for out in one_slot.generate(first):
            tokens.extend(out.token_ids)
            holds_the_slot.set()
        done.append(first.request_id)

    running = asyncio.create_task(run_first())
    await holds_the_slot.wait()
    queued = asyncio.create_task(run(batch(request_for(PROMPT, 8, rid="batch-queued-0000001"))))
    await asyncio.sleep(0.01)
    urgent = asyncio.create_task(run(request_for(PROMPT, 8, rid="interactive-00000001")))
    await asyncio.gather(running, queued, urgent)
    assert len(tokens) == 400, "the first request must hold the slot while the others queue"
    assert done == ["batch-running-000001", "interactive-00000001", "batch-queued-0000001"]
