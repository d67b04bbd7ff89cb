"""What the benchmarks that drive the dev stack share: starting it on a pools file, and streaming one chat
completion through its ingress."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from infra.devstack import DevStack, Endpoints


@contextmanager
def dev_stack(pools: str, **options: Any) -> Iterator[tuple[DevStack, Endpoints]]:
    """The dev stack on this pools file (TOML text), started, and stopped on the way out; `options` go to
    `DevStack`."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pools.toml"
        config.write_text(pools)
        stack = DevStack(Path(tmp) / "stack", config_path=config, **options)
        endpoints = stack.start()
        try:
            yield stack, endpoints
        finally:
            stack.stop()


@dataclass(frozen=True)
class Streamed:
    ttft: float | None  # seconds from sending to the first content, None if no content came
    chunks: int  # chunks with content
    prompt_tokens: int
    completion_tokens: int
    completion_id: str  # the chunks' `id`: "chatcmpl-" and the request id


async def stream_chat(
    client: httpx.AsyncClient,
    endpoints: Endpoints,
    body: dict[str, Any],
    on_chunk: Callable[[], None] | None = None,
) -> Streamed:
    """One streamed chat completion (`body` asks for `stream_options.include_usage`), read to [DONE];
    `on_chunk` is called as each chunk with content arrives."""
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    t0 = time.perf_counter()
    ttft = None
    chunks = prompt_tokens = completion_tokens = 0
    completion_id = ""
    async with client.stream("POST", endpoints.url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not completion_id and line.startswith("data: {") and '"id":"' in line:
                completion_id = line.split('"id":"', 1)[1].split('"', 1)[0]
            if '"content":"' in line and '"content":""' not in line:
                chunks += 1
                if on_chunk is not None:
                    on_chunk()
                if ttft is None:
                    ttft = time.perf_counter() - t0
            elif '"prompt_tokens":' in line:
                prompt_tokens = int(line.split('"prompt_tokens":')[1].split(",")[0])
                completion_tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
            if line == "data: [DONE]":
                break
    return Streamed(ttft, chunks, prompt_tokens, completion_tokens, completion_id)
