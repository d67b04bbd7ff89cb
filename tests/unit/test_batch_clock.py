"""The simulated engine's batched timing: steps shared by every running request, counted exactly."""

import asyncio
from collections import deque

import pytest

from gpu_workers.batch_clock import BatchClock, Running, prefill_plan, step_s
from gpu_workers.simulated import SimulatedEngine, reply_text
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import InferenceRequest, SamplingParams

CONFIG = SimulatedEngineConfig(
    timing="batched", step_ms=1.0, step_ms_per_seq=0.0, prefill_ms_per_token=0.0, chunk_tokens=2048,
    kv_blocks=4096, min_words=40, max_words=40,
)  # fmt: skip


def request(rid: str, prompt_tokens: int, max_tokens: int) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid * 16, pool="sim", model="m", team="t", prompt_token_ids=tuple([7] * prompt_tokens),
        sampling=SamplingParams(max_tokens=max_tokens), created_at=0.0, deadline=1e12,
    )  # fmt: skip


def test_a_step_costs_its_base_its_decoding_sequences_and_the_tokens_it_prefills() -> None:
    config = SimulatedEngineConfig(
        step_ms=15, step_ms_per_seq=0.5, prefill_ms_per_token=0.01, chunk_tokens=1000
    )
    assert step_s(config, 0, 0) == pytest.approx(0.015)
    assert step_s(config, 10, 0) == pytest.approx(0.020)
    assert step_s(config, 10, 1000) == pytest.approx(0.030)
    assert step_s(config, 10, 100) == pytest.approx(0.021)


def test_a_steps_prefill_budget_goes_to_the_waiting_prompts_in_order() -> None:
    a, b, c = Running(1500), Running(400), Running(900)
    assert prefill_plan(deque([a, b, c]), 2048) == [(a, 1500), (b, 400), (c, 148)]
    assert prefill_plan(deque([c]), 2048) == [(c, 900)]
    assert (a.prefill_left, c.prefill_left) == (1500, 900)  # a plan spends nothing


async def timed(engine: SimulatedEngine, req: InferenceRequest) -> tuple[str, int]:
    """The text, and the engine step whose end gave its last token (the clock may take one idle step
    more before the request's end reaches it: that step gives nothing)."""
    assert engine._clock is not None
    text, last = "", 0
    async for out in engine.generate(req):
        text += out.text
        last = engine._clock.steps
    return text, last


async def test_one_request_takes_its_prefill_steps_then_a_step_per_token() -> None:
    engine = SimulatedEngine(CONFIG, block_size=16)
    text, last = await timed(engine, request("a", 3000, 5))  # two prefill steps, then four more tokens
    assert text == reply_text(request("a", 3000, 5))[:5]
    assert last == 2 + 4
    await engine.close()


async def test_concurrent_requests_share_steps() -> None:
    engine = SimulatedEngine(CONFIG, block_size=16)
    both = await asyncio.gather(timed(engine, request("a", 1000, 5)), timed(engine, request("b", 1000, 5)))
    assert [len(t) for t, _ in both] == [5, 5]
    assert [last for _, last in both] == [1 + 4, 1 + 4]  # one step prefills both; each step decodes both
    stats = engine.stats()
    assert (stats.running, stats.kv_blocks_free) == (0, 4096)
    await engine.close()


async def test_a_prompt_arriving_during_a_step_joins_the_next_one() -> None:
    clock = BatchClock(CONFIG)
    first = clock.start(100)
    await asyncio.sleep(0)  # one turn of the loop: the clock plans its first step and starts it
    late = clock.start(100)
    await first.tokens.get()
    assert clock.steps == 1
    await late.tokens.get()
    assert clock.steps == 2  # not prefilled by the step that was running when it came
    await clock.close()


async def test_a_higher_priority_prompt_goes_ahead_of_waiting_prompts_but_not_a_started_one() -> None:
    config = CONFIG.model_copy(update={"chunk_tokens": 100})
    clock = BatchClock(config)
    started = clock.start(3000, priority=3)  # batch: thirty 1 ms steps of prefill
    await asyncio.sleep(0.005)  # a few steps in (timers fire in deadline order)
    assert started.started
    assert started.prefill_left > 0
    clock.start(500, priority=3)
    interactive = clock.start(500, priority=1)
    assert [s is interactive for s in clock._waiting] == [False, True, False]
    assert clock._waiting[0] is started
    await clock.close()
    fcfs = BatchClock(config.model_copy(update={"scheduling": "fcfs"}))
    first, second = fcfs.start(500, priority=3), fcfs.start(500, priority=1)
    assert list(fcfs._waiting) == [first, second]
    await fcfs.close()
