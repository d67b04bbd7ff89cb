"""Engine steps for the simulated engine's `batched` timing: the fleet simulator's replica model, live.

Each step decodes one token for every sequence that was decoding when it began, and prefills up to
`chunk_tokens` of the waiting prompts, first come first served (chunked prefill, as vLLM schedules it).
A step lasts

    step_ms + step_ms_per_seq x decoding (+ prefill_ms_per_token x chunk_tokens while prefilling)

which is `bench.sim.engine.TimingModel`'s formula, so the same trace can run through `sluice dev` and
through `bench/sim` with one timing model. A prompt's first token comes at the end of the step that
finishes its prefill; each later step gives it one more.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from queue_schemas.config import SimulatedEngineConfig


@dataclass(eq=False)
class Running:
    """One request's place in the engine: prompt tokens left to prefill, and its tokens as they come."""

    prefill_left: int
    tokens: asyncio.Queue[None] = field(default_factory=asyncio.Queue)


def step_s(config: SimulatedEngineConfig, decoding: int, prefilling: bool) -> float:
    ms = config.step_ms + config.step_ms_per_seq * decoding
    if prefilling:
        ms += config.prefill_ms_per_token * config.chunk_tokens
    return ms / 1000


def prefill_step(waiting: deque[Running], budget: int) -> list[Running]:
    """Spend one step's prefill budget on the waiting prompts in order; returns those it finished."""
    finished = []
    while waiting and budget > 0:
        seq = waiting[0]
        spent = min(budget, seq.prefill_left)
        seq.prefill_left -= spent
        budget -= spent
        if seq.prefill_left:
            break
        finished.append(waiting.popleft())
    return finished


class BatchClock:
    def __init__(self, config: SimulatedEngineConfig) -> None:
        self._config = config
        self._waiting: deque[Running] = deque()
        self._decoding: set[Running] = set()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    def start(self, prompt_tokens: int) -> Running:
        """Queue a prompt of this many uncached tokens (at least one is computed)."""
        seq = Running(max(1, prompt_tokens))
        self._waiting.append(seq)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return seq

    def leave(self, seq: Running) -> None:
        """The sequence is done or aborted: it takes no further steps."""
        self._decoding.discard(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while self._waiting or self._decoding:
            decoding = list(self._decoding)
            # Steps follow one schedule from the start of the busy spell: a step the event loop woke late
            # for is made up by the next ones, so the engine's rate is the model's, not the loop's.
            deadline += step_s(self._config, len(decoding), bool(self._waiting))
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self.steps += 1
            for seq in decoding:
                if seq in self._decoding:
                    seq.tokens.put_nowait(None)
            for seq in prefill_step(self._waiting, self._config.chunk_tokens):
                self._decoding.add(seq)
                seq.tokens.put_nowait(None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
