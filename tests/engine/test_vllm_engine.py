"""The vLLM engine on CPU, driven through the engine interface the worker uses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from bench.otlp_sink import OtlpSink
from dispatcher.migration import continuation, progress_of
from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import EngineOutput, RequestFailed
from gpu_workers.vllm_engine import VllmEngine
from plumbing import tracing
from plumbing.model_store import ModelStore
from queue_schemas.messages import FinalChunk, FinishReason, InferenceRequest, KvEventKind, TokenChunk
from queue_schemas.prefix import block_hashes, cache_salt
from queue_schemas.settings import BusSettings
from tests.engine.conftest import BLOCK, ENGINE_TIMEOUT, request_for, tiny_pool
from tests.waiting import eventually

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(ENGINE_TIMEOUT), pytest.mark.asyncio(loop_scope="module")]

LONG_PROMPT = [(i * 7) % 400 + 3 for i in range(300)]  # two full blocks of 128 and a partial one


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    """An OTLP/HTTP receiver for the engine's own spans and this process's (tracing on for the module)."""
    with OtlpSink() as receiver, pytest.MonkeyPatch.context() as env:
        for name, value in {**receiver.env(), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}.items():
            env.setenv(name, value)  # vLLM's exporter reads its protocol here
        tracing.configure(BusSettings(), "worker")
        try:
            yield receiver
        finally:
            tracing.shutdown()
            env.setattr(tracing, "ENABLED", False)
            env.setattr(tracing, "_tracer", None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, sink: OtlpSink
) -> AsyncIterator[VllmEngine]:
    pool = tiny_pool(str(tiny_llama))
    assert pool.vllm is not None
    traced = pool.vllm.model_copy(update={"engine_traces_endpoint": sink.endpoint + "/v1/traces"})
    e = VllmEngine(
        pool.model_copy(update={"vllm": traced}),
        ModelStore(tmp_path_factory.mktemp("cache")),
        spec_decoding=False,
    )
    await e.start()
    yield e
    await e.close()


async def test_the_engine_span_joins_the_request_trace(engine: VllmEngine, sink: OtlpSink) -> None:
    rid = "req-traced-00000001"
    span = tracing.start("generate", tracing.new_trace(), attributes={tracing.REQUEST_ID: rid})
    with tracing.current(span):
        outs = await collect(engine, request_for([10, 11, 12, 13], max_tokens=4, rid=rid))
    tracing.end(span)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    ours = tracing.traceparent_of(span)
    assert ours is not None

    async def engine_span() -> bool:
        return any(s.attributes.get("gen_ai.request.id") == rid for s in sink.spans)

    await eventually(engine_span, 30, "vLLM's span of the request")
    (request_span,) = [s for s in sink.spans if s.attributes.get("gen_ai.request.id") == rid]
    assert request_span.trace_id == ours.split("-")[1], "the engine's span is in the request's trace"
    assert request_span.parent_id == ours.split("-")[2], "under the worker's span"
    untraced = await collect(engine, request_for([10, 11], max_tokens=2, rid="req-untraced-000001"))
    assert untraced[-1].finish_reason is FinishReason.LENGTH


async def collect(engine: VllmEngine, request: InferenceRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


async def settled_stats(engine: VllmEngine) -> tuple[int, int]:
    """Run a one-token request to completion so the engine steps and reports; then (running, free)."""
    await collect(engine, request_for([5, 6, 7], max_tokens=1, rid="probe-0000000000000001"))

    async def idle() -> bool:
        return engine.stats().running == 0

    await eventually(idle, 10, "the engine's stats reporting no running request")
    stats = engine.stats()
    return stats.running, stats.kv_blocks_free


async def stored_events(engine: VllmEngine, expected: set[str]) -> set[str]:
    """Every hash the engine's KV events report stored, read until they include `expected`."""
    stored: set[str] = set()

    async def seen() -> bool:
        changes = engine.take_kv_changes()
        stored.update(h for kind, hashes in changes if kind is KvEventKind.STORED for h in hashes)
        return expected <= stored

    await eventually(seen, 10, f"KV events storing {len(expected)} blocks")
    return stored


async def test_streams_deltas_then_a_final_with_usage(engine: VllmEngine) -> None:
    outs = await collect(engine, request_for([10, 11, 12, 13], max_tokens=12))
    # One delta per step; the engine merges the deltas of steps its reader had not yet taken.
    assert 1 < len(outs) <= 12, "streamed as deltas, not one answer"
    assert all(o.num_tokens >= 1 for o in outs)
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert sum(o.num_tokens for o in outs) == 12
    assert outs[-1].prompt_tokens == 4
    assert any(o.text for o in outs)
    stats = engine.stats()
    assert stats.block_size == BLOCK
    assert stats.kv_blocks_total > 0


async def test_abort_frees_the_request(engine: VllmEngine) -> None:
    _, free_before = await settled_stats(engine)
    stream = engine.generate(request_for(LONG_PROMPT, max_tokens=1500, rid="abort-000000000000001"))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    running, free_after = await settled_stats(engine)
    assert running == 0
    assert free_after >= free_before - 1  # the aborted request's blocks went back (bar cached prefixes)


async def test_same_prompt_twice_hits_the_prefix_cache(engine: VllmEngine) -> None:
    prompt = [t + 1 for t in LONG_PROMPT]  # a prompt no other test sends
    engine.take_kv_changes()
    first = await collect(engine, request_for(prompt, max_tokens=4, rid="prefix-00000000000001"))
    second = await collect(engine, request_for(prompt, max_tokens=4, rid="prefix-00000000000002"))
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == 2 * BLOCK
    # The engine's events name the chain hashes.
    await stored_events(engine, set(block_hashes(prompt, BLOCK)))
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 2 * BLOCK
    assert stats.prefix_query_tokens > stats.prefix_hit_tokens


async def test_a_cached_prefix_is_reused_only_under_the_same_salt(engine: VllmEngine) -> None:
    prompt = [t + 2 for t in LONG_PROMPT]  # a prompt no other test sends
    team_a, team_b = cache_salt("a", shared=False), cache_salt("b", shared=False)
    engine.take_kv_changes()
    first = await collect(engine, request_for(prompt, max_tokens=4, rid="salt-a-00000000001", salt=team_a))
    again = await collect(engine, request_for(prompt, max_tokens=4, rid="salt-a-00000000002", salt=team_a))
    other = await collect(engine, request_for(prompt, max_tokens=4, rid="salt-b-00000000001", salt=team_b))
    assert [first[-1].cached_tokens, again[-1].cached_tokens, other[-1].cached_tokens] == [0, 2 * BLOCK, 0]
    salted_a, salted_b = (set(block_hashes(prompt, BLOCK, salt=s)) for s in (team_a, team_b))
    stored = await stored_events(engine, salted_a | salted_b)  # each team's salted chain is named
    assert not set(block_hashes(prompt, BLOCK)) & stored, "no unsalted name for a salted prompt"


async def test_stop_sequences_and_sampling_fields_reach_the_engine(engine: VllmEngine) -> None:
    greedy = await collect(engine, request_for([20, 21, 22], max_tokens=8))
    text = "".join(o.text for o in greedy)
    again = await collect(engine, request_for([20, 21, 22], max_tokens=8, rid="req-0000000000000002"))
    assert "".join(o.text for o in again) == text, "greedy decoding is repeatable"
    # A stop string from the middle of the greedy answer ends the same answer just before it.
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    stopped = await collect(engine, request_for([20, 21, 22], 8, "stop-000000000000001", stop=[stop]))
    assert "".join(o.text for o in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason is FinishReason.STOP
    seeded = [
        "".join(
            o.text
            for o in await collect(
                engine, request_for([20, 21], 8, f"seed-00000000000000{i}", temperature=1.0, seed=7)
            )
        )
        for i in range(2)
    ]
    assert seeded[0] == seeded[1], "the same seed gives the same sample"


async def test_a_prompt_longer_than_the_context_is_an_engine_error(engine: VllmEngine) -> None:
    with pytest.raises(RequestFailed, match="refused the request"):
        await collect(engine, request_for(list(range(3, 403)) * 6, max_tokens=4, rid="long-0000000000000001"))
    assert engine.failure() is None, "one bad request does not kill the engine"


async def chunks(engine: VllmEngine, request: InferenceRequest) -> list[TokenChunk | FinalChunk]:
    """The chunks a worker would publish for `request` (a chunk per engine output)."""
    coalescer = ChunkCoalescer(request.request_id, "w", 0.0, request.resume)
    found = []
    async for out in engine.generate(request):
        chunk = coalescer.add(out, 0.0)
        if chunk is not None:
            found.append(chunk)
    return found


def leading(stream: list[TokenChunk | FinalChunk], at_most: int) -> list[TokenChunk | FinalChunk]:
    """The first chunks of a stream, holding at most `at_most` tokens (at least the first chunk, never
    the final one): where a worker may have been cut off. The engine groups tokens into outputs as its
    consumer keeps up, so the cut is counted in tokens, not chunks."""
    taken: list[TokenChunk | FinalChunk] = []
    for c in stream[:-1]:
        if taken and sum(len(t.token_ids) for t in taken) + len(c.token_ids) > at_most:
            break
        taken.append(c)
    return taken


@pytest.mark.parametrize("cut", [1, 4, 9])
async def test_a_moved_greedy_request_goes_on_exactly_as_an_uninterrupted_run(
    engine: VllmEngine, cut: int
) -> None:
    """What one worker delivered, then the continuation run by the engine: together the same tokens
    and text as one uninterrupted run, with its usage."""
    prompt = LONG_PROMPT[:140]  # a full block of 128 and a partial one
    whole = await chunks(engine, request_for(prompt, 24, "uncut-0000000000001"))
    delivered = leading(whole, cut)
    assert 0 < sum(len(c.token_ids) for c in delivered) < 24, "the continuation has tokens to generate"
    moved = continuation(request_for(prompt, 24, f"moved-00000000000{cut:02}"), progress_of(delivered), BLOCK)
    together = delivered + await chunks(engine, moved)
    assert [t for c in together for t in c.token_ids] == [t for c in whole for t in c.token_ids]
    assert "".join(c.text for c in together) == "".join(c.text for c in whole)
    assert [c.seq for c in together] == list(range(len(together)))
    last, expected = together[-1], whole[-1]
    assert isinstance(last, FinalChunk)
    assert isinstance(expected, FinalChunk)
    assert last.finish_reason == expected.finish_reason
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (140, 24)


async def test_speculative_decoding_gives_the_same_greedy_output(
    engine: VllmEngine, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompts = [LONG_PROMPT[:50] * 3, [9, 8, 7, 6, 9, 8, 7, 6, 9, 8, 7]]
    plain = [
        "".join(o.text for o in await collect(engine, request_for(p, 48, f"plain-00000000000{i:04}")))
        for i, p in enumerate(prompts)
    ]
    spec = VllmEngine(
        tiny_pool(str(tiny_llama)), ModelStore(tmp_path_factory.mktemp("cache")), spec_decoding=True
    )
    await spec.start()
    try:
        speculated = [
            "".join(o.text for o in await collect(spec, request_for(p, 48, f"spec-000000000000{i:04}")))
            for i, p in enumerate(prompts)
        ]
        figures = spec._figures
    finally:
        await spec.close()
    assert speculated == plain
    assert figures.spec_drafted > 0, "speculation really ran"
