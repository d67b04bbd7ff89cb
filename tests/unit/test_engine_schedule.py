"""The simulated engine's scheduler (vLLM's rules: slots, KV blocks, priority, preemption), and the
simulated engine running interactive work ahead of batch work."""

import asyncio

from gpu_workers.engine_schedule import EngineSchedule, Entry
from gpu_workers.simulated import SimulatedEngine, reply_text
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import InferenceRequest, Priority, SamplingParams

BATCH, INTERACTIVE = 3, 1


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    schedule = EngineSchedule(slots=1, kv_blocks=100, block_size=16, policy="priority")
    first = Entry(BATCH, 10)
    assert schedule.submit(first) == [first]
    later_batch, interactive = Entry(BATCH, 10), Entry(INTERACTIVE, 10)
    assert schedule.submit(later_batch) == []
    assert schedule.submit(interactive) == []
    assert schedule.finish(first) == [interactive]
    assert schedule.finish(interactive) == [later_batch]


def test_fcfs_starts_them_in_arrival_order() -> None:
    schedule = EngineSchedule(slots=1, kv_blocks=100, block_size=16, policy="fcfs")
    first, batch, interactive = Entry(BATCH, 10), Entry(BATCH, 10), Entry(INTERACTIVE, 10)
    for entry in (first, batch, interactive):
        schedule.submit(entry)
    assert schedule.finish(first) == [batch]


def test_a_request_waits_for_blocks_without_preempting_to_start() -> None:
    schedule = EngineSchedule(slots=8, kv_blocks=4, block_size=16, policy="priority")
    batch = Entry(BATCH, 40)  # 3 blocks for 41 tokens
    schedule.submit(batch)
    interactive = Entry(INTERACTIVE, 40)
    assert schedule.submit(interactive) == []  # 1 block free: it waits, as vLLM's admission does
    assert (schedule.waiting, schedule.preemptions) == (1, 0)


def test_growth_without_free_blocks_preempts_the_lowest_priority_latest_arrival() -> None:
    schedule = EngineSchedule(slots=8, kv_blocks=6, block_size=16, policy="priority")
    old_batch, new_batch, interactive = Entry(BATCH, 15), Entry(BATCH, 15), Entry(INTERACTIVE, 15)
    for entry in (old_batch, new_batch, interactive):
        schedule.submit(entry)
    assert schedule.free_blocks == 3
    assert schedule.grow(interactive, 48) == []  # 3 blocks: takes the 2 free ones
    assert schedule.free_blocks == 1
    assert schedule.grow(interactive, 64) == []
    assert schedule.grow(interactive, 65) == [new_batch]  # a fifth block: the newer batch request goes
    assert not new_batch.running
    assert (new_batch.blocks, new_batch.preempted, schedule.preemptions) == (0, 1, 1)
    assert schedule.waiting == 1
    # Re-admitted once blocks free, it needs what it held (its prompt and output so far) again.
    assert schedule.finish(interactive) == [new_batch]
    assert new_batch.blocks == 1


def test_under_fcfs_growth_preempts_the_last_admitted_whatever_its_priority() -> None:
    schedule = EngineSchedule(slots=8, kv_blocks=2, block_size=16, policy="fcfs")
    batch, interactive = Entry(BATCH, 15), Entry(INTERACTIVE, 15)
    schedule.submit(batch)
    schedule.submit(interactive)
    assert schedule.grow(batch, 17) == [interactive]


def test_a_request_that_is_itself_the_lowest_preempts_itself() -> None:
    schedule = EngineSchedule(slots=8, kv_blocks=2, block_size=16, policy="priority")
    interactive, batch = Entry(INTERACTIVE, 15), Entry(BATCH, 15)
    schedule.submit(interactive)
    schedule.submit(batch)
    assert schedule.grow(batch, 17) == [batch]
    assert schedule.running == [interactive]


def request(rid: str, priority: Priority, prompt: int = 40, max_tokens: int = 30) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid * 8, pool="sim", model="m", team="t", prompt_token_ids=tuple(range(1, prompt + 1)),
        sampling=SamplingParams(max_tokens=max_tokens), priority=priority, created_at=0.0, deadline=1e12,
    )  # fmt: skip


async def finish_order(config: SimulatedEngineConfig, requests: list[InferenceRequest]) -> list[str]:
    engine = SimulatedEngine(config, block_size=16)
    done: list[str] = []

    async def run(r: InferenceRequest) -> None:
        text = "".join([out.text async for out in engine.generate(r)])
        assert text == reply_text(r)[: r.sampling.max_tokens]
        done.append(r.request_id[0])

    tasks = []
    for r in requests:  # in this order, each one queued before the next arrives
        tasks.append(asyncio.create_task(run(r)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert engine.stats().kv_blocks_free == config.kv_blocks
    return done


def test_the_engine_runs_an_interactive_request_ahead_of_waiting_batch_requests() -> None:
    reqs = [request("a", Priority.BATCH), request("b", Priority.BATCH), request("c", Priority.INTERACTIVE)]
    config = SimulatedEngineConfig(ttft_ms=1, token_ms=1, max_running=1)
    assert asyncio.run(finish_order(config, reqs)) == ["a", "c", "b"]
    fcfs = config.model_copy(update={"scheduling": "fcfs"})
    assert asyncio.run(finish_order(fcfs, reqs)) == ["a", "b", "c"]


def test_preempted_batch_requests_finish_with_their_whole_answer() -> None:
    """Three long batch answers fill the KV blocks; an interactive request then arrives. Its growth
    preempts batch requests, which wait and compute their tokens again; every answer is still whole."""
    for timing in ("per_request", "batched"):
        config = SimulatedEngineConfig(
            timing=timing, ttft_ms=1, token_ms=1, step_ms=1, max_running=8, kv_blocks=12, min_words=30
        )
        batch = [request(c, Priority.BATCH, prompt=40, max_tokens=100) for c in "abc"]
        interactive = request("i", Priority.INTERACTIVE, prompt=40, max_tokens=100)

        async def go(
            config: SimulatedEngineConfig, batch: list[InferenceRequest], interactive: InferenceRequest
        ) -> tuple[list[str], int]:
            engine = SimulatedEngine(config, block_size=16)
            done: list[str] = []

            async def run(r: InferenceRequest) -> None:
                text = "".join([out.text async for out in engine.generate(r)])
                assert text == reply_text(r, 30, 40)[: r.sampling.max_tokens]
                done.append(r.request_id[0])

            tasks = [asyncio.create_task(run(r)) for r in batch]
            await asyncio.sleep(0.02)
            tasks.append(asyncio.create_task(run(interactive)))
            await asyncio.gather(*tasks)
            return done, engine.stats().preemptions

        done, preemptions = asyncio.run(go(config, batch, interactive))
        assert preemptions > 0, timing
        assert sorted(done) == ["a", "b", "c", "i"], timing
        assert done.index("i") < done.index("c"), timing  # it arrived last; the latest batch one gave way
