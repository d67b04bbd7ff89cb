"""A model-free engine: deterministic text, a timing model, and real KV block accounting.

Tokens are UTF-8 bytes (the `bytes` tokenizer), and the text is ASCII, so one character is one token.
Timing `per_request`: time to first token grows with the prompt length; each further token costs
`token_ms`. Timing `batched`: requests share engine steps (`BatchClock`), as the fleet simulator models
a replica. Which requests run is vLLM's scheduling (`EngineSchedule`): slots, KV blocks, engine priority,
and preemption when blocks run out; a preempted request computes its prompt and output so far again
when it is re-admitted, and its client sees only a pause.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Sequence

from gpu_workers.adapters import AdapterLru
from gpu_workers.batch_clock import BatchClock, Running
from gpu_workers.engine import (
    EngineDead,
    EngineOutput,
    EngineStats,
    KvChange,
    RequestFailed,
)
from gpu_workers.engine_schedule import EngineSchedule, Entry
from gpu_workers.handoff import KvTransfer
from gpu_workers.json_sample import Budget, UnsupportedSchema, sample
from gpu_workers.prefix_cache import PrefixCache
from queue_schemas.config import SimulatedEngineConfig
from queue_schemas.messages import FinishReason, InferenceRequest, KvEventKind

_WORDS = (
    "the", "queue", "moves", "tokens", "from", "prompt", "to", "answer", "while", "workers", "keep",
    "their", "caches", "warm", "and", "every", "request", "finds", "a", "place", "on", "a", "replica",
    "with", "room", "to", "spare", "so", "nothing", "waits", "for", "long",
)  # fmt: skip


def client_prompt(request: InferenceRequest) -> tuple[int, ...]:
    """The prompt the client sent: a moved request continues the answer to it, not to its own prompt."""
    return request.prompt_token_ids[: request.client_prompt_tokens]


def reply_text(request: InferenceRequest, min_words: int = 12, max_words: int = 40) -> str:
    """The deterministic answer to a request: the answer to the prompt its client sent."""
    return answer_to(client_prompt(request), min_words, max_words)


def answer_to(prompt_token_ids: Sequence[int], min_words: int = 12, max_words: int = 40) -> str:
    """The deterministic answer to a prompt: min_words..max_words words picked by a hash of the prompt."""
    digest = hashlib.sha256(bytes(t % 256 for t in prompt_token_ids)).digest()
    n_words = min_words + int.from_bytes(digest[:4], "big") % (max_words - min_words + 1)
    words = [_WORDS[(digest[i % len(digest)] + i * 7) % len(_WORDS)] for i in range(n_words)]
    return " ".join(words).capitalize() + "."


def structured_text(request: InferenceRequest, words: str) -> str:
    """Guided output: a JSON object, or a value valid against the request's schema."""
    structured = request.sampling.structured
    assert structured is not None
    if structured.kind == "json_object" or structured.schema_text is None:
        return json.dumps({"answer": " ".join(words.split()[:6])})
    seed = int.from_bytes(hashlib.sha256(bytes(t % 256 for t in client_prompt(request))).digest()[:4], "big")
    try:
        budget = Budget(client_max_tokens(request) + 1)  # one character is one token here
        return json.dumps(sample(json.loads(structured.schema_text), seed=seed, budget=budget))
    except (UnsupportedSchema, ValueError, KeyError, TypeError) as exc:
        raise RequestFailed(f"the simulated engine cannot follow this schema: {exc}") from None


def client_max_tokens(request: InferenceRequest) -> int:
    return request.sampling.max_tokens if request.resume is None else request.resume.max_tokens


def apply_stops(text: str, max_tokens: int, stops: tuple[str, ...]) -> tuple[str, FinishReason]:
    """Cut the answer at the earliest stop sequence (excluded) or at max_tokens characters."""
    cut, reason = len(text), FinishReason.STOP
    for stop in stops:
        at = text.find(stop)
        if 0 <= at < cut:
            cut = at
    if cut > max_tokens:
        cut, reason = max_tokens, FinishReason.LENGTH
    return text[:cut], reason


class SimulatedEngine:
    def __init__(self, config: SimulatedEngineConfig, block_size: int, max_loras: int = 4) -> None:
        self._config = config
        self._adapters = AdapterLru(max_loras)
        self._block_size = block_size
        self._schedule = EngineSchedule(config.max_running, config.kv_blocks, block_size, config.scheduling)
        self._admitted: dict[Entry, asyncio.Event] = {}
        self._decoded: list[tuple[float, int]] = []
        self._cache = PrefixCache(config.kv_blocks)
        self._kv_changes: list[KvChange] = []
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._generated = 0
        self._dead: str | None = None
        self._clock = BatchClock(config) if config.timing == "batched" else None
        self._steps: dict[Entry, Running] = {}  # batched: each running request's place in the clock

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        if self._clock is not None:
            await self._clock.close()

    def failure(self) -> str | None:
        return self._dead

    def take_kv_changes(self) -> list[KvChange]:
        changes, self._kv_changes = self._kv_changes, []
        return changes

    def _cache_prompt(self, block_hashes: tuple[str, ...]) -> int:
        """Look the prompt's blocks up, then keep them cached; returns how many leading blocks were hits."""
        matched = self._cache.match(block_hashes)
        stored, evicted = self._cache.insert(block_hashes)
        if evicted:
            self._kv_changes.append((KvEventKind.REMOVED, tuple(evicted)))
        if stored:
            self._kv_changes.append((KvEventKind.STORED, tuple(stored)))
        return matched

    async def abort(self, request_id: str) -> None:
        # Closing the generator aborts; nothing else holds the request.
        return None

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._block_size)

    def stats(self) -> EngineStats:
        now = time.monotonic()
        self._decoded = [(t, n) for t, n in self._decoded if now - t < 5.0]
        schedule = self._schedule
        return EngineStats(
            kv_blocks_total=self._config.kv_blocks,
            kv_blocks_free=schedule.free_blocks,
            block_size=self._block_size,
            running=len(schedule.running),
            waiting=schedule.waiting,
            decode_tokens_per_s=sum(n for _, n in self._decoded) / 5.0,
            prefix_query_tokens=self._prefix_queries,
            prefix_hit_tokens=self._prefix_hits,
            preemptions=schedule.preemptions,
            adapters=self._adapters.held(),
            adapter_slots=self._adapters.capacity,
        )

    def _wake(self, started: list[Entry]) -> None:
        for entry in started:
            self._admitted[entry].set()

    def _preempt(self, victims: list[Entry]) -> None:
        """Preempted requests stop; each notices at its next step and waits to be admitted again."""
        for victim in victims:
            self._admitted[victim].clear()
            self._kick(victim)

    def _kick(self, entry: Entry) -> None:
        seq = self._steps.get(entry)
        if seq is not None:  # batched: it leaves the clock and its pending wait for a token returns
            self._steps.pop(entry)
            if self._clock is not None:
                self._clock.leave(seq)
            seq.tokens.put_nowait(None)

    async def _prefill(self, entry: Entry, uncached: int) -> None:
        """Wait to run, then compute `uncached` tokens; the first output token is then due."""
        await self._admitted[entry].wait()
        if self._clock is not None:
            seq = self._steps[entry] = self._clock.start(uncached, entry.priority)
            await seq.tokens.get()  # the end of the step that finishes its prefill
        else:  # a fixed cost plus a cost per token the cache did not hold
            await asyncio.sleep((self._config.ttft_ms + uncached * self._config.prefill_ms_per_token) / 1000)

    async def _next_token(self, entry: Entry) -> None:
        seq = self._steps.get(entry)
        if seq is not None:
            await seq.tokens.get()  # the end of the step that gives this sequence its token
        else:
            await asyncio.sleep(self._config.token_ms / 1000)

    async def generate(
        self, request: InferenceRequest, kv: KvTransfer | None = None
    ) -> AsyncIterator[EngineOutput]:
        if self._dead is not None:
            raise EngineDead(self._dead)
        prompt_tokens = len(request.prompt_token_ids)
        if self._blocks_for(prompt_tokens + request.sampling.max_tokens) > self._config.kv_blocks:
            raise RequestFailed("prompt and max_tokens exceed the engine's KV capacity")
        reply = reply_text(request, self._config.min_words, self._config.max_words)
        if request.sampling.structured is not None:
            reply = structured_text(request, reply)
        text, reason = apply_stops(reply, client_max_tokens(request), request.sampling.stop)
        if request.resume is not None:  # the answer goes on where the lost worker left it
            text = text[request.resume.delivered_tokens :]
        entry = Entry(request.engine_priority, prompt_tokens)
        self._admitted[entry] = asyncio.Event()
        try:
            self._wake(self._schedule.submit(entry))
            await self._admitted[entry].wait()
            if request.adapter is not None and self._adapters.use(request.adapter).loaded:
                await asyncio.sleep(self._config.adapter_load_ms / 1000)
            cached = self._cache_prompt(request.block_hashes) * self._block_size
            if kv is not None and not kv.save:  # a handoff's KV is loaded, as vLLM's connector loads it
                cached = max(cached, (prompt_tokens - 1) // self._block_size * self._block_size)
            self._prefix_queries += prompt_tokens
            self._prefix_hits += cached
            await self._prefill(entry, prompt_tokens - cached)
            i, due = 0, True  # due: the token after a prefill comes with it
            while i < len(text):
                if not entry.running:  # preempted: wait, then compute the prompt and output so far again
                    self._kick(entry)
                    await self._prefill(entry, prompt_tokens + i - cached)
                    due = True
                if not due:
                    await self._next_token(entry)
                due = False
                if not entry.running:
                    continue
                victims = self._schedule.grow(entry, prompt_tokens + i + 1)
                self._preempt(victims)
                if entry in victims:
                    continue  # it preempted itself: no block for this token
                if i == self._config.fail_after_tokens:
                    if self._config.fault_kind == "bug":
                        raise RuntimeError(f"simulated bug after {i} tokens")
                    raise RequestFailed(f"simulated engine fault after {i} tokens")
                if self._dead is not None:
                    raise EngineDead(self._dead)
                self._generated += 1
                if self._generated == self._config.die_after_tokens:
                    self._dead = f"the simulated engine died after {self._generated} tokens"
                    raise EngineDead(self._dead)
                self._decoded.append((time.monotonic(), 1))
                last = i == len(text) - 1
                token = text[i].encode()[0]  # ASCII: one byte, one token
                yield EngineOutput(text[i], 1, reason if last else None, prompt_tokens, cached, (token,))
                i += 1
            if not text:
                yield EngineOutput("", 0, reason, prompt_tokens, cached)
        finally:
            seq = self._steps.pop(entry, None)
            if self._clock is not None and seq is not None:
                self._clock.leave(seq)
            self._admitted.pop(entry, None)
            self._wake(self._schedule.finish(entry))
