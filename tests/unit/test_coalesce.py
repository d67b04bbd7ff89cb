import pytest

from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import EngineOutput
from plumbing.window import chunks_per_stream_s, flush_window_s
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


def test_the_window_widens_with_the_streams_open_up_to_its_cap() -> None:
    assert flush_window_s(0.015, 0.1, 1, 16) == 0.015
    assert flush_window_s(0.015, 0.1, 16, 16) == 0.015, "up to the knee, as an idle worker"
    assert flush_window_s(0.015, 0.1, 32, 16) == pytest.approx(0.03), "then in proportion to the streams"
    assert flush_window_s(0.015, 0.1, 1000, 16) == 0.1, "never wider than the cap"
    assert flush_window_s(0.015, 0.1, 1000, 0) == 0.015, "a knee of 0 keeps it fixed"
    assert flush_window_s(0.2, 0.1, 1000, 16) == 0.2, "a cap below the base never narrows it"


def test_a_stream_sends_a_chunk_a_token_or_a_chunk_a_window() -> None:
    assert chunks_per_stream_s(20, 0.015) == 20, "tokens slower than the window: one each"
    assert chunks_per_stream_s(20, 0.1) == pytest.approx(10), "faster: a chunk a window"
    assert chunks_per_stream_s(20, 0) == 20, "no window: every token"


def test_a_window_that_widens_mid_stream_gathers_more() -> None:
    window = [0.01]
    c = ChunkCoalescer("r" * 16, "w", lambda: window[0])
    assert c.add(out("a"), now=0.0) is not None, "the first token goes out at once"
    assert c.add(out("b"), now=0.02) is not None
    window[0] = 0.1
    assert c.add(out("c"), now=0.04) is None, "held: the window is wider now"
    chunk = c.add(out("d"), now=0.13)
    assert chunk is not None
    assert chunk.text == "cd"


def out(text: str) -> EngineOutput:
    return EngineOutput(text, 1, prompt_tokens=4)
