"""Engine steps for the simulated engine's `batched` timing: the fleet simulator's replica model, live.

Each step decodes one token for every sequence that was decoding when it began, and prefills up to
`chunk_tokens` of the prompts that were waiting when it began, in order of engine priority and then
arrival (first come first served under `fcfs`; chunked prefill, as vLLM schedules it: a prompt that
arrives during a step joins the next one). A step lasts

    step_ms + step_ms_per_seq x decoding + prefill_ms_per_token x tokens it prefills

which is `bench.sim.engine.TimingModel`'s formula (the simulator spreads a prefill chunk's cost over the
tokens it covers), so the same trace can run through `sluice dev` and through `bench/sim` with one
timing model. A prompt's first token comes at the end of the step that finishes its prefill; each later
step gives it one more.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from plumbing.tasks import stop_task
from queue_schemas.config import SimulatedEngineConfig


@dataclass(eq=False)
class Running:
    """One request's place in the engine: prompt tokens left to prefill, and its tokens as they come."""

    prefill_left: int
    tokens: asyncio.Queue[None] = field(default_factory=asyncio.Queue)
    key: tuple[int, int] = (0, 0)  # (engine priority, arrival) under priority; (0, arrival) under fcfs
    started: bool = False  # part of its prompt is prefilled: vLLM runs it on ahead of waiting prompts


def step_s(config: SimulatedEngineConfig, decoding: int, prefill_tokens: int) -> float:
    ms = config.step_ms + config.step_ms_per_seq * decoding + config.prefill_ms_per_token * prefill_tokens
    return ms / 1000


def prefill_plan(waiting: deque[Running], budget: int) -> list[tuple[Running, int]]:
    """One step's prefill budget over the waiting prompts in order: (prompt, tokens it gets). Pure."""
    plan = []
    for seq in waiting:
        if budget <= 0:
            break
        spent = min(budget, seq.prefill_left)
        plan.append((seq, spent))
        budget -= spent
    return plan


class BatchClock:
    def __init__(self, config: SimulatedEngineConfig) -> None:
        self._config = config
        self._waiting: deque[Running] = deque()
        self._decoding: set[Running] = set()
        self._task: asyncio.Task[None] | None = None
        self._arrivals = itertools.count()
        self.steps = 0

    def start(self, prompt_tokens: int, priority: int = 0) -> Running:
        """Queue a prompt of this many uncached tokens (at least one is computed)."""
        rank = priority if self._config.scheduling == "priority" else 0
        seq = Running(max(1, prompt_tokens), key=(rank, next(self._arrivals)))
        # Behind every prompt of its priority or a higher one (a lower number), and behind any prompt
        # whose prefill has begun (vLLM schedules running requests before waiting ones).
        at = len(self._waiting)
        while at and self._waiting[at - 1].key > seq.key and not self._waiting[at - 1].started:
            at -= 1
        self._waiting.insert(at, seq)
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
            plan = prefill_plan(self._waiting, self._config.chunk_tokens)
            # Steps follow one schedule from the start of the busy spell: a step the event loop woke late
            # for is made up by the next ones, so the engine's rate is the model's, not the loop's.
            deadline += step_s(self._config, len(decoding), sum(tokens for _, tokens in plan))
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self.steps += 1
            for seq in decoding:
                if seq in self._decoding:
                    seq.tokens.put_nowait(None)
            for seq, tokens in plan:
                if seq not in self._waiting:
                    continue  # it left during the step
                seq.prefill_left -= tokens
                seq.started = True
                if not seq.prefill_left:
                    self._waiting.remove(seq)
                    self._decoding.add(seq)
                    seq.tokens.put_nowait(None)

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
