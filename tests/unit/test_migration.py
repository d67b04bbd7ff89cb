"""Migration bookkeeping: what was delivered, what is sent again, and how usage adds up.

A request runs on the simulated engine through the worker's coalescer; its chunks are cut off at some
point (the worker is lost), the continuation is built from them as the dispatcher builds it, and run
again on a fresh engine. The chunks of both runs together must equal the chunks of one uninterrupted run
in text, sequence numbers, usage and finish reason.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import pytest

from dispatcher.migration import Progress, continuation, decide_move, progress_of, refusal
from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.simulated import SimulatedEngine
from ingress.relay import LocalError, events
from ingress.streams import RESYNC, HubDisconnected
from plumbing.replay import LogState, in_order
from queue_schemas.codec import encode
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    InferenceRequest,
    SamplingParams,
    StreamEvent,
    StructuredOutput,
    TokenChunk,
)
from queue_schemas.prefix import block_hashes

ENGINE = SimulatedEngineConfig(ttft_ms=0, token_ms=0, min_words=10, max_words=10)
PROMPT = tuple(b"a prompt that is longer than one block of sixteen")


def request(max_tokens: int = 40, **sampling: Any) -> InferenceRequest:
    now = time.time()
    return InferenceRequest(
        request_id="move-me-0001", pool="sim", model="sluice-sim", team="acme", prompt_token_ids=PROMPT,
        block_hashes=tuple(block_hashes(PROMPT, 16, salt="sluice-team:acme")), cache_salt="sluice-team:acme",
        sampling=SamplingParams(max_tokens=max_tokens, **sampling), created_at=now, start_by=now + 5,
        deadline=now + 60,
    )  # fmt: skip


def run(req: InferenceRequest, flush_after_s: float = 0.0) -> list[TokenChunk | FinalChunk]:
    """Every chunk the worker would send for `req` (a chunk per token with no coalescing window)."""

    async def go() -> list[TokenChunk | FinalChunk]:
        coalescer = ChunkCoalescer(req.request_id, "w", flush_after_s, req.resume)
        chunks = []
        async for out in SimulatedEngine(ENGINE, block_size=16).generate(req):
            chunk = coalescer.add(out, time.monotonic())
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    return asyncio.run(go())


def text(chunks: list[TokenChunk | FinalChunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.mark.parametrize("cuts", [(1,), (7,), (39,), (3, 12), (1, 2, 3)])
def test_moved_runs_add_up_to_one_uninterrupted_run(cuts: tuple[int, ...]) -> None:
    whole = run(request())
    final = whole[-1]
    assert isinstance(final, FinalChunk)
    delivered: list[TokenChunk | FinalChunk] = []
    current = request()
    for n, cut in enumerate(cuts, start=1):
        delivered += run(current)[: cut - len(delivered)]
        done = progress_of(delivered)
        assert refusal(current, done, limit=3) is None
        current = continuation(current, done, block_size=16)
        assert current.resume is not None
        assert current.resume.migrations == n
        assert current.prompt_token_ids == PROMPT + done.token_ids, "the client's prompt, then the output"
        assert current.sampling.max_tokens == 40 - len(done.token_ids)
        assert current.start_by is None, "a started request is bound by its deadline only"
        assert current.block_hashes == tuple(
            block_hashes(current.prompt_token_ids, 16, salt="sluice-team:acme")
        ), "hashed under the team's salt, as the engine caches it"
    rest = run(current)
    together = delivered + rest
    assert [c.seq for c in together] == list(range(len(together)))
    assert text(together) == text(whole)
    last = together[-1]
    assert isinstance(last, FinalChunk)
    assert last.finish_reason == final.finish_reason
    assert last.usage.prompt_tokens == final.usage.prompt_tokens == len(PROMPT), "the prompt counts once"
    assert last.usage.completion_tokens == final.usage.completion_tokens == 40
    assert last.usage.cached_tokens <= len(PROMPT)


def test_coalesced_chunks_carry_every_token_id() -> None:
    chunks = run(request(), flush_after_s=10.0)  # one chunk for the first token, one with the rest
    assert len(chunks) == 2
    ids = [t for c in chunks for t in c.token_ids]
    assert bytes(ids).decode() == text(chunks)
    assert sum(c.num_tokens for c in chunks) == len(ids) == 40


def test_a_log_that_ended_needs_no_move_and_a_gap_stops_the_reading() -> None:
    chunks = run(request(max_tokens=5))
    assert progress_of(chunks).ended
    error = ErrorChunk(request_id="move-me-0001", seq=2, code="engine_error", message="x")
    assert progress_of([*chunks[:2], error]).ended
    raw = {str(c.seq).encode(): encode(c) for c in chunks if c.seq != 2}
    assert [c.seq for c in in_order(raw)] == [0, 1], "read as far as the log is unbroken"
    assert [c.seq for c in in_order(raw, from_seq=3)] == [3, 4]
    raw[b"1"] = b"not a chunk"
    assert [c.seq for c in in_order(raw)] == [0]


@pytest.mark.parametrize(
    ("sampling", "why"),
    [
        ({"structured": StructuredOutput(kind="json_object")}, "structured output"),
        ({"presence_penalty": 0.5}, "penalties"),
        ({"frequency_penalty": -0.5}, "penalties"),
        ({"stop": ("\n",)}, "stop sequences"),
    ],
)
def test_what_cannot_resume_exactly_is_refused(sampling: dict[str, Any], why: str) -> None:
    done = Progress(next_seq=2, token_ids=(1, 2), text="ab", ended=False)
    reason = refusal(request(**sampling), done, limit=3)
    assert reason is not None
    assert why in reason


def test_the_migration_limit_counts_earlier_moves() -> None:
    done = Progress(next_seq=1, token_ids=(104,), text="h", ended=False)
    once = continuation(request(), done, block_size=16)
    assert refusal(request(), done, limit=1) is None
    more = Progress(next_seq=2, token_ids=(104, 105), text="hi", ended=False)
    reason = refusal(once, more, limit=1)
    assert reason is not None
    assert "already moved 1 times" in reason
    assert refusal(request(), done, limit=0) is not None


class Feed:
    """Stands in for a hub subscription: hands out queued payloads, then waits."""

    def __init__(self, items: list[bytes | BaseException]) -> None:
        self.items = deque(items)

    def ready(self) -> bool:
        return bool(self.items)

    async def next(self, within_s: float) -> bytes:
        if not self.items:
            raise TimeoutError
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


def relay(feed: Feed, log: list[TokenChunk | FinalChunk]) -> list[StreamEvent]:
    async def read(request_id: str, from_seq: int) -> LogState:
        return LogState(in_order({str(c.seq).encode(): encode(c) for c in log}, from_seq), len(log), ())

    async def go() -> list[StreamEvent]:
        return [e async for e in events(feed, request(), read)]  # type: ignore[arg-type]

    return asyncio.run(go())


def test_the_relay_fills_a_gap_from_the_log_and_drops_repeats() -> None:
    chunks = run(request(max_tokens=6))
    live = [encode(chunks[0]), encode(chunks[3]), encode(chunks[1]), encode(chunks[4]), encode(chunks[5])]
    seen = relay(Feed(list(live)), chunks)
    assert [e.seq for e in seen] == [0, 1, 2, 3, 4, 5]
    assert isinstance(seen[-1], FinalChunk)


def test_after_a_reconnect_the_relay_catches_up_from_the_log() -> None:
    chunks = run(request(max_tokens=6))
    seen = relay(Feed([encode(chunks[0]), RESYNC]), chunks)  # the rest went out while it was away
    assert [e.seq for e in seen] == [0, 1, 2, 3, 4, 5]
    assert text(seen) == text(chunks)  # type: ignore[arg-type]


def test_a_gap_the_log_cannot_fill_or_a_lost_hub_ends_the_stream_with_one_error() -> None:
    chunks = run(request(max_tokens=6))
    seen = relay(Feed([encode(chunks[0]), encode(chunks[4])]), chunks[:1])
    # Made by the relay itself (no part of the log): LocalError, an ErrorChunk that gets no SSE id.
    assert [type(e) for e in seen] == [TokenChunk, LocalError]
    assert isinstance(seen[-1], ErrorChunk)
    assert seen[-1].code == "worker_lost"
    seen = relay(Feed([encode(chunks[0]), HubDisconnected("gone for good")]), chunks)
    assert [type(e) for e in seen] == [TokenChunk, LocalError]


def test_what_becomes_of_a_lost_workers_request() -> None:
    whole = run(request())
    assert decide_move(request(), [], limit=3, block_size=16).outcome == "restarted"
    ended = decide_move(request(), whole, limit=3, block_size=16)
    assert (ended.outcome, ended.logged) == ("ended", len(whole))
    moved = decide_move(request(), whole[:5], limit=3, block_size=16)
    assert (moved.outcome, moved.logged) == ("moved", 5)
    assert moved.request.resume is not None
    assert moved.request.resume.delivered_tokens == 5
    refused = decide_move(request(stop=("x",)), whole[:5], limit=3, block_size=16)
    assert (refused.outcome, refused.logged) == ("refused", 5)
    assert refused.used_tokens == len(PROMPT) + 5, "the prompt and what the client was sent"
    assert "stop sequences" in refused.reason
