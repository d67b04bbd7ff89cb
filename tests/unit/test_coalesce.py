from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import EngineOutput
from queue_schemas.messages import FinalChunk, FinishReason, TokenChunk


def test_first_token_is_sent_at_once_then_coalesced() -> None:
    c = ChunkCoalescer("r" * 16, "w", flush_after_s=0.05)
    first = c.add(EngineOutput("a", 1, prompt_tokens=4), now=0.0)
    assert isinstance(first, TokenChunk)
    assert (first.seq, first.text) == (0, "a")
    assert c.add(EngineOutput("b", 1, prompt_tokens=4), now=0.01) is None
    assert c.add(EngineOutput("c", 1, prompt_tokens=4), now=0.02) is None
    second = c.add(EngineOutput("d", 1, prompt_tokens=4), now=0.06)
    assert isinstance(second, TokenChunk)
    assert (second.seq, second.text, second.num_tokens) == (1, "bcd", 3)


def test_final_chunk_carries_the_rest_and_usage() -> None:
    c = ChunkCoalescer("r" * 16, "w", flush_after_s=10)
    c.add(EngineOutput("a", 1, prompt_tokens=4), now=0.0)
    c.add(EngineOutput("b", 1, prompt_tokens=4), now=0.1)
    final = c.add(EngineOutput("c", 1, FinishReason.LENGTH, prompt_tokens=4, cached_tokens=2), now=0.2)
    assert isinstance(final, FinalChunk)
    assert (final.seq, final.text, final.finish_reason) == (1, "bc", FinishReason.LENGTH)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (4, 3, 2)


def test_flush_hands_over_what_is_gathered_before_an_error() -> None:
    c = ChunkCoalescer("r" * 16, "w", flush_after_s=10)
    c.add(EngineOutput("a", 1, prompt_tokens=4), now=0.0)
    c.add(EngineOutput("b", 1, prompt_tokens=4), now=0.1)
    pending = c.flush()
    assert pending is not None
    assert (pending.seq, pending.text, pending.num_tokens) == (1, "b", 1)
    assert c.seq == 2
    assert c.flush() is None
