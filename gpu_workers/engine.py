"""The engine interface every backend implements: the simulated engine and vLLM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_workers.handoff import KvTransfer
from queue_schemas.messages import FinishReason, InferenceRequest, KvEventKind

KvChange = tuple[KvEventKind, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """New text since the previous output of the same request; the last one has finish_reason set."""

    text: str
    num_tokens: int
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    kv_params: dict[str, Any] | None = None  # with the last output: the KV connector's transfer parameters


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    running: int
    waiting: int
    decode_tokens_per_s: float
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0  # running requests sent back to wait (their KV freed), in total
    adapters: tuple[str, ...] = ()  # LoRA adapters held, least recently used first
    adapter_slots: int = 0  # adapters it runs at once (0: no adapters)


class EngineError(Exception):
    """Something the engine could not do. The worker reports a failure during a request to that request's
    client (`engine_error`); the subclasses say which kind it is."""


class RequestFailed(EngineError):
    """This request alone failed (refused parameters, a prompt over the model's length, an unknown
    adapter); the engine goes on serving others."""


class StartFailed(EngineError):
    """The engine could not start: the model or its adapters are missing, the configuration does not fit
    the engine, or the engine itself failed to load. The worker reports itself failed and exits."""


class EngineDead(EngineError):
    """The engine died while serving: this request and every one after it fail until the worker is
    replaced."""


class Engine(Protocol):
    async def start(self) -> None:
        """Load the model; returns when the engine can take requests."""
        ...

    def generate(
        self, request: InferenceRequest, kv: KvTransfer | None = None
    ) -> AsyncIterator[EngineOutput]:
        """Stream outputs for one request. Closing the iterator early aborts the request. `kv`: its part
        in a prefill/decode handoff (save the prompt's KV, or load it)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def take_kv_changes(self) -> list[KvChange]:
        """Prefix-cache changes since the last call, in order, as the project's chain hashes."""
        ...

    def failure(self) -> str | None:
        """Why the engine can no longer serve anything (it died), or None while it is healthy."""
        ...

    async def close(self) -> None: ...


class EarlyStart:
    """An engine stream whose first step is already under way: prefill runs while the worker checks
    that the request may start. Nothing is taken from it until it is iterated, so nothing is published
    before the check says go; `discard` aborts it (closing the stream aborts the request in the engine)."""

    def __init__(self, stream: AsyncIterator[EngineOutput]) -> None:
        self._stream = stream
        self._first: asyncio.Task[EngineOutput] | None = asyncio.ensure_future(self._step())

    async def _step(self) -> EngineOutput:
        return await anext(self._stream)

    def __aiter__(self) -> EarlyStart:
        return self

    async def __anext__(self) -> EngineOutput:
        first, self._first = self._first, None
        if first is not None:
            return await first
        return await anext(self._stream)

    async def discard(self) -> None:
        """Abort the stream if it is still running; what it raised, if anything, is dropped."""
        first, self._first = self._first, None
        if first is not None:
            first.cancel()
            with contextlib.suppress(BaseException):
                await first
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
