import asyncio

from gpu_workers.simulated import SimulatedEngine, apply_stops, reply_text
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import FinishReason, InferenceRequest, SamplingParams


def request(max_tokens: int = 500, stop: tuple[str, ...] = ()) -> InferenceRequest:
    return InferenceRequest(
        request_id="r" * 16, pool="sim", model="m", team="t", prompt_token_ids=tuple(range(40)),
        sampling=SamplingParams(max_tokens=max_tokens, stop=stop), created_at=0.0, deadline=1e12,
    )  # fmt: skip


def test_reply_is_deterministic_ascii() -> None:
    text = reply_text(request())
    assert text == reply_text(request())
    assert text.isascii()
    assert text.endswith(".")


def test_stops_cut_before_the_stop_sequence() -> None:
    assert apply_stops("hello world", 100, ("o w", "ld")) == ("hell", FinishReason.STOP)
    assert apply_stops("hello world", 3, ()) == ("hel", FinishReason.LENGTH)
    assert apply_stops("hello", 100, ()) == ("hello", FinishReason.STOP)


def test_engine_streams_one_token_per_character_and_frees_its_blocks() -> None:
    engine = SimulatedEngine(SimulatedEngineConfig(ttft_ms=1, token_ms=0, kv_blocks=64), block_size=16)

    async def run() -> list[str]:
        return [out.text async for out in engine.generate(request(max_tokens=10))]

    pieces = asyncio.run(run())
    assert len(pieces) == 10
    assert "".join(pieces) == reply_text(request())[:10]
    stats = engine.stats()
    assert (stats.running, stats.kv_blocks_free) == (0, 64)
