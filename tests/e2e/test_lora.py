"""LoRA adapters through `sluice dev`: a tiny vLLM pool of two workers with two adapters the test makes,
asked for through the official client by their own model ids."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import openai
import pytest
import redis.asyncio as aioredis

from infra.models import build_lora_adapter, build_tiny_llama
from queue_schemas.names import Names
from tests.e2e.dev_cli import DevRun, pool_heartbeats, sluice_dev, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

POOLS = """
[[pools]]
name = "tiny"
model = "tiny"
engine = "vllm"
block_size = 128
context_tokens = 2048
max_loras = 2
adapters = [
  {{ name = "tiny-sql", source = "{sql}" }},
  {{ name = "tiny-poem", source = "{poem}" }},
]
[pools.vllm]
source = "{source}"
kv_cache_gib = 0.25
max_num_seqs = 4
cpu_threads = 1
[pools.scaling]
min_replicas = 2
max_replicas = 2
"""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevRun]:
    tmp = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(tmp / "tiny-llama")
    sql, poem = (build_lora_adapter(tmp / name, base, seed) for seed, name in ((1, "sql"), (2, "poem")))
    config = tmp / "pools.toml"
    config.write_text(POOLS.format(source=base, sql=sql, poem=poem))
    with sluice_dev(tmp, "--config", str(config)) as run:
        asyncio.run(wait_ready(run.env["SLUICE_REDIS_URL"], {"tiny": 2}))
        yield run


def _client(run: DevRun) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=run.env["SLUICE_URL"] + "/v1", api_key=run.env["SLUICE_API_KEY"], max_retries=0
    )


def _placed_on(run: DevRun, model: str, prompt: str) -> tuple[str, str]:
    """Stream a greedy completion; return the worker its placement record names (read while it runs) and
    the text."""

    async def worker_of(request_id: str) -> str:
        redis = aioredis.Redis.from_url(run.env["SLUICE_REDIS_URL"])
        try:
            raw = await redis.get(Names().placement(request_id))
            assert raw is not None, "the placement record exists while the request runs"
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        finally:
            await redis.aclose()

    worker, text = "", list[str]()
    with _client(run) as client:
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=48, temperature=0, stream=True
        )
        for chunk in stream:
            if not worker:
                worker = asyncio.run(worker_of(chunk.id.split("-", 1)[1]))
            text.extend(c.text for c in chunk.choices)
    return worker, "".join(text)


def test_adapters_are_models_of_their_pool_and_an_unknown_one_is_not_found(lora_run: DevRun) -> None:
    with _client(lora_run) as client:
        models = {m.id: m for m in client.models.list()}
        assert {"tiny", "tiny-sql", "tiny-poem"} <= set(models)
        assert models["tiny-sql"].owned_by == "tiny"
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="tiny-prose", prompt="hello", max_tokens=2)
        assert err.value.code == "model_not_found"


def test_a_second_request_for_an_adapter_goes_where_it_is_held(lora_run: DevRun) -> None:
    first_sql, sql_text = _placed_on(lora_run, "tiny-sql", "the first question about tables")
    first_poem, poem_text = _placed_on(lora_run, "tiny-poem", "the first line of a poem")
    _, base_text = _placed_on(lora_run, "tiny", "the first question about tables")
    # Other prompts, so no cached prefix draws them: only the adapter held. (Placement blind to
    # adapters would send all six to the first workers by chance once in 64 runs.)
    for topic in ("joins", "indexes", "views"):
        again_sql, _ = _placed_on(lora_run, "tiny-sql", f"another question, about {topic}")
        again_poem, _ = _placed_on(lora_run, "tiny-poem", f"another line, about {topic} by a river")
        assert (again_sql, again_poem) == (first_sql, first_poem)
    _, same_sql = _placed_on(lora_run, "tiny-sql", "the first question about tables")
    assert same_sql == sql_text, "greedy output under an adapter is repeatable"
    assert sql_text != base_text, "the adapter changes the answer"
    beats = asyncio.run(pool_heartbeats(lora_run.env["SLUICE_REDIS_URL"], "tiny"))
    held = {hb.worker_id: set(hb.adapters) for hb in beats}
    assert "tiny-sql" in held[first_sql]
    assert "tiny-poem" in held[first_poem]
    assert poem_text


async def _set_drain(run: DevRun, worker_ids: list[str], asked: bool) -> None:
    """The scaler's drain request, as an operator sets it: the worker takes no new placements."""
    redis = aioredis.Redis.from_url(run.env["SLUICE_REDIS_URL"])
    try:
        keys = [Names().drain_request(w) for w in worker_ids]
        if asked:
            for key in keys:
                await redis.set(key, b"1", ex=120)
        elif keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()


async def _states(run: DevRun) -> dict[str, str]:
    beats = await pool_heartbeats(run.env["SLUICE_REDIS_URL"], "tiny")
    return {hb.worker_id: hb.state for hb in beats}


def _wait_states(run: DevRun, wanted: dict[str, str]) -> None:
    for _ in range(600):
        states = asyncio.run(_states(run))
        if all(states.get(w) == state for w, state in wanted.items()):
            return
        time.sleep(0.05)
    raise AssertionError(f"worker states did not become {wanted}: {states}")


def _completion_worker(run: DevRun, request_id: str) -> str:
    async def go() -> str:
        redis = aioredis.Redis.from_url(run.env["SLUICE_REDIS_URL"])
        try:
            raw = await redis.get(Names().placement(request_id))
            assert raw is not None, f"{request_id} has a placement record"
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def test_cached_tokens_are_never_shared_between_adapters(lora_run: DevRun) -> None:
    """Both adapters on one worker, the other drained: the only way a cached prefix could cross from one
    adapter to the other."""
    asyncio.run(wait_ready(lora_run.env["SLUICE_REDIS_URL"], {"tiny": 2}))
    keep, *others = sorted(asyncio.run(_states(lora_run)))
    asyncio.run(_set_drain(lora_run, others, True))
    prompt = " ".join(f"row {i} holds the value {i * 7}." for i in range(80))
    cached: dict[str, list[int]] = {"tiny-sql": [], "tiny-poem": []}
    placed: set[str] = set()
    prompt_tokens = 0
    try:
        _wait_states(lora_run, {keep: "ready", **{w: "draining" for w in others}})
        with _client(lora_run) as client:
            for model in ("tiny-sql", "tiny-poem", "tiny-sql", "tiny-poem"):
                reply = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
                assert reply.usage is not None
                details = reply.usage.prompt_tokens_details
                cached[model].append((details.cached_tokens or 0) if details else 0)
                assert reply.model == model
                prompt_tokens = reply.usage.prompt_tokens
                placed.add(_completion_worker(lora_run, reply.id.split("-", 1)[1]))
    finally:
        asyncio.run(_set_drain(lora_run, others, False))
    assert placed == {keep}, "all four requests ran on one worker"
    assert prompt_tokens > 2 * 128
    assert cached["tiny-sql"][0] == 0
    assert cached["tiny-poem"][0] == 0, "the same prompt cached under tiny-sql is not a hit for tiny-poem"
    assert cached["tiny-sql"][1] > 0
    assert cached["tiny-poem"][1] > 0
